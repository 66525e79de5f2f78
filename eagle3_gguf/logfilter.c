/* llama.cpp's log callback (llama_log_set) in front of native.py's Python one: DEBUG lines, and the CONT pieces that
 * continue them, stop here unless they are wanted (-v). ggml-cuda logs about three DEBUG lines a decode ("CUDA Graph
 * id N reused"), each a ctypes call into Python inside the decode (bench/NOTES.md "log-filter").
 * Built once by eagle3_gguf/native.py with the system C compiler (cbuild.py); it links against nothing. */
#include <stddef.h>
#include <stdint.h>

enum { LEVEL_DEBUG = 1, LEVEL_CONT = 5 }; /* enum ggml_log_level (ggml.h) */

struct logfilter {
    void (*forward)(int32_t level, const char * text, void * user_data); /* the Python callback */
    int32_t debug;    /* DEBUG lines go on too */
    int32_t dropping; /* the last line was a DEBUG one dropped: its CONT pieces go with it */
};

size_t eagle3_logfilter_size(void) { return sizeof(struct logfilter); } /* checked against ctypes' */

void eagle3_logfilter(int32_t level, const char * text, void * user_data) {
    struct logfilter * f = (struct logfilter *) user_data;
    if (level != LEVEL_CONT) {
        f->dropping = level == LEVEL_DEBUG && !f->debug;
    }
    if (!f->dropping) {
        f->forward(level, text, NULL);
    }
}
