// Exits 0 when ggml's AMX kernels can run here, as this compiler builds them: the kernel grants the
// tile state (arch_prctl ARCH_REQ_XCOMP_PERM) and a tile configuration filled field by field, then
// loaded with _tile_loadconfig, is the one the CPU receives. GCC 12 at -O3 drops those field stores
// (the intrinsic's read of the struct is not seen), so the CPU loads stack garbage and faults, as
// llama.cpp's first AMX matrix multiply does (ggml-cpu/amx/mmq.cpp). Built with the build's own
// compiler at -O3 -march=native and run at configure time by amx_guard.cmake.
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr long XFEATURE_XTILEDATA = 18;

struct TileConfig {
    uint8_t palette_id = 0;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {0};
    uint16_t colsb[16] = {0};
    uint8_t rows[16] = {0};
};

__attribute__((noinline)) void configure_tiles(int n_tiles) {
    alignas(64) TileConfig config = {};
    config.palette_id = 1;
    for (int i = 0; i < n_tiles; ++i) {
        config.rows[i] = 16;
        config.colsb[i] = 64;
    }
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_release();
}

}  // namespace

int main() {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0)
        return 1;
    configure_tiles(8);
    return 0;
}
