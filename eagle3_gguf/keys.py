"""Every GGUF key, tensor name and architecture fact this project uses, in one place.

Checked against the pinned llama.cpp (llama-cpp-python 0.3.36, build 0c1e570): keys against
`src/llama-arch.cpp` / `gguf-py/gguf/constants.py`, tensor names against `src/models/eagle3.cpp`.
`tests/test_keys.py` re-derives them from the vendored tree when it is present.
"""

from __future__ import annotations

ARCH_EAGLE3 = "eagle3"
ARCH_LLAMA = "llama"

# -- general keys ---------------------------------------------------------------------------------
KEY_ARCHITECTURE = "general.architecture"
KEY_NAME = "general.name"
KEY_FILE_TYPE = "general.file_type"
KEY_ALIGNMENT = "general.alignment"
# a LoRA adapter's (llama.cpp's llama-adapter.cpp): general.type "adapter", adapter.type "lora"
KEY_GENERAL_TYPE = "general.type"
KEY_ADAPTER_TYPE = "adapter.type"
KEY_ADAPTER_LORA_ALPHA = "adapter.lora.alpha"
LORA_A, LORA_B = ".lora_a", ".lora_b"  # a weight's adapter tensors: its name + these

# -- per-architecture keys ("{arch}." prefix) -----------------------------------------------------
KEY_CONTEXT_LENGTH = "{arch}.context_length"
KEY_EMBEDDING_LENGTH = "{arch}.embedding_length"
KEY_BLOCK_COUNT = "{arch}.block_count"
KEY_FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
KEY_VOCAB_SIZE = "{arch}.vocab_size"
KEY_HEAD_COUNT = "{arch}.attention.head_count"
KEY_HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
KEY_KEY_LENGTH = "{arch}.attention.key_length"
KEY_VALUE_LENGTH = "{arch}.attention.value_length"
KEY_RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
KEY_NORM_EPS = "{arch}.attention.layer_norm_epsilon"
KEY_SLIDING_WINDOW = "{arch}.attention.sliding_window"  # cells a sliding-window layer attends (exactness probe)
KEY_ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
KEY_ROPE_FREQ_BASE = "{arch}.rope.freq_base"
KEY_ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"
KEY_ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"
KEY_ROPE_SCALING_ORIG_CTX = "{arch}.rope.scaling.original_context_length"
KEY_ROPE_SCALING_ATTN_FACTOR = "{arch}.rope.scaling.attn_factor"
KEY_ROPE_SCALE_LINEAR = "{arch}.rope.scale_linear"  # the older spelling of a linear scaling factor

# -- EAGLE-3 keys (LLM_KV_TARGET_LAYERS, LLM_KV_TARGET_HIDDEN_SIZE, LLM_KV_NORM_BEFORE_*) ----------
KEY_TARGET_LAYERS = "{arch}.target_layers"  # exactly 3 ids, input-of-layer convention
KEY_TARGET_HIDDEN_SIZE = "{arch}.target_hidden_size"
KEY_NORM_BEFORE_RESIDUAL = "{arch}.norm_before_residual"  # optional, default false
KEY_NORM_BEFORE_FC = "{arch}.norm_before_fc"  # optional, default false
N_TARGET_LAYERS = 3  # load_arch_hparams throws unless target_layers holds exactly 3 ids

# -- EAGLE 3.1 state the pinned graph has no place for, in our own key namespace -------------------
# The pinned loader refuses a GGUF holding any tensor its arch does not create ("done_getting_tensors:
# wrong number of tensors"), so the fc_norm weights travel as a metadata array: stock llama.cpp loads
# the file and ignores them; eagle3_gguf.head_norms applies them around the graph.
OURS_PREFIX = "eagle3gguf."
KEY_FC_NORM = "eagle3gguf.fc_norm"  # bool: one RMSNorm per target feature before fc (speculators fc_norm)
KEY_FC_NORM_WEIGHT = "eagle3gguf.fc_norm.weight"  # FLOAT32 array [n_feat * n_embd_tgt]: fc_norm.{i} in order
KEY_NORM_OUTPUT = "eagle3gguf.norm_output"  # bool: output_norm(h), not h, is fed back as g across draft steps

# -- tokenizer ------------------------------------------------------------------------------------
TOKENIZER_PREFIX = "tokenizer."
KEY_TOKENIZER_MODEL = "tokenizer.ggml.model"
KEY_TOKENIZER_TOKENS = "tokenizer.ggml.tokens"
KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_CHAT_TEMPLATE = "tokenizer.chat_template"
KEY_TOKENIZER_EOS_ID = "tokenizer.ggml.eos_token_id"
KEY_TOKENIZER_EOT_ID = "tokenizer.ggml.eot_token_id"
KEY_TOKENIZER_EOM_ID = "tokenizer.ggml.eom_token_id"
# token texts llama.cpp also ends a generation at, by name (llama_vocab::impl::load: its end-of-generation list,
# and the fill-in-the-middle pad / repo / file-separator tokens it adds to that set)
EOG_TOKEN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
})


def arch_key(template: str, arch: str) -> str:
    """Fill the `{arch}` prefix of a per-architecture key."""
    return template.format(arch=arch)


# -- tensor names (src/models/eagle3.cpp, LLM_TENSOR_NAMES) ---------------------------------------
T_TOKEN_EMBD = "token_embd.weight"  # optional in a head: the target's is borrowed via ctx_other
T_OUTPUT_NORM = "output_norm.weight"
T_OUTPUT = "output.weight"  # optional in a head: the target's lm_head is borrowed when absent
T_ROPE_FREQS = "rope_freqs.weight"
T_FC = "fc.weight"  # {3 * n_embd_tgt, n_embd}
T_ENC_OUTPUT_NORM = "enc.output_norm.weight"  # only with norm_before_fc
T_D2T = "d2t"  # I64 [n_draft_vocab], absolute target token ids

T_ATTN_NORM = "blk.{bid}.attn_norm.weight"  # input_layernorm, on the token embedding
T_ATTN_NORM_2 = "blk.{bid}.attn_norm_2.weight"  # hidden_norm, on g
T_ATTN_Q = "blk.{bid}.attn_q.weight"
T_ATTN_K = "blk.{bid}.attn_k.weight"
T_ATTN_V = "blk.{bid}.attn_v.weight"
T_ATTN_OUT = "blk.{bid}.attn_output.weight"
T_FFN_NORM = "blk.{bid}.ffn_norm.weight"
T_FFN_GATE = "blk.{bid}.ffn_gate.weight"
T_FFN_UP = "blk.{bid}.ffn_up.weight"
T_FFN_DOWN = "blk.{bid}.ffn_down.weight"


def blk(template: str, bid: int = 0) -> str:
    """Fill the block index of a per-layer tensor name."""
    return template.format(bid=bid)


# Tensors every eagle3 head must carry (create_tensor(..., 0) in load_arch_tensors).
EAGLE3_REQUIRED_TENSORS = (
    T_FC,
    T_OUTPUT_NORM,
    blk(T_ATTN_NORM),
    blk(T_ATTN_NORM_2),
    blk(T_ATTN_Q),
    blk(T_ATTN_K),
    blk(T_ATTN_V),
    blk(T_ATTN_OUT),
    blk(T_FFN_NORM),
    blk(T_FFN_GATE),
    blk(T_FFN_UP),
    blk(T_FFN_DOWN),
)

# Target architectures whose graph sets `t_layer_inp` at the pin, so that
# llama_set_embeddings_layer_inp works (any other arch hits GGML_ASSERT in llama-graph.cpp).
# Derived from src/models/*.cpp + llama_model_mapping + LLM_ARCH_NAMES; see tests/test_keys.py.
HOOKED_TARGET_ARCHS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan_vl", "lfm2", "llama", "mimo2",
    "minimax-01", "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "qwen3", "qwen35",
    "qwen35moe", "qwen3moe", "qwen3next", "qwen4exp",
})

# Unhooked target architectures whose layer inputs eagle3_gguf.capture takes from the graph tensors
# `l_out-{il}` through an eval callback: a standard residual stream (tests/test_keys.py checks that their
# graphs name it), each run losslessly in tests (test_capture.py, test_seed_heads.py). Not MLA or recurrent
# graphs, where "layer input" means something else; others (phi3, glm4, ...) once a test target runs them.
CAPTURED_TARGET_ARCHS = frozenset({"gemma3", "llama4", "mistral3", "qwen2"})

# Architectures whose every layer caches every token's K and V (no sliding window, recurrent layers or compressed
# latent), so that head count x head size x layers bounds their KV cache from below (pair.check_kv_memory)
FULL_KV_ARCHS = frozenset({"llama", "mistral3", "qwen2", "qwen3", "qwen3moe"})

# Weight types that repacking does not make batch-variant: Q4_0 repacked as q4_0_8x8 stays exact (244 benchmark
# prompts identical), the rest are not repacked at the pin. A target with any other type is loaded unrepacked
# (Q4_K repacked as q4_K_8x8: batch rows from 4 up computed by another kernel than lone rows). Not a claim of
# batch invariance: F32/F16/BF16 matrices take llamafile's sgemm for 2+ rows and K-quants a tiled matmul from 8
# (bench/NOTES.md, exactness); the exactness probe measures that where the run happens.
REPACK_EXACT_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "I32", "I64"})

# Target architectures whose graph also sets `t_h_nextn` (the final hidden state), so that a head
# asking for layer id == n_layer gets real features. The llama graph does not: there the pinned
# upstream runtime silently reads zeros, and we refuse the pair instead.
FINAL_OUTPUT_TARGET_ARCHS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "mimo2", "nemotron_h", "qwen35", "qwen35moe", "qwen3next",
})

# Layout of the staging API in libllama (src/llama-ext.h has no extern "C": Itanium-mangled names).
MANGLED_SYMBOLS = {
    "llama_set_embeddings_layer_inp": "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
    "llama_get_embeddings_layer_inp": "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
    "llama_set_embeddings_nextn": "_Z26llama_set_embeddings_nextnP13llama_contextbb",
    "llama_get_embeddings_nextn": "_Z26llama_get_embeddings_nextnP13llama_context",
    "llama_get_embeddings_nextn_ith": "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
    "llama_model_target_layer_ids": "_Z28llama_model_target_layer_idsPK11llama_model",
    "llama_model_target_layer_ids_n": "_Z30llama_model_target_layer_ids_nPK11llama_model",
    "llama_model_n_devices": "_Z21llama_model_n_devicesPK11llama_model",
    "llama_model_get_device": "_Z22llama_model_get_devicePK11llama_modeli",
}

LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# -- added by the converter (convert/): general.quantization_version, written by upstream's
#    convert_hf_to_gguf.py (gguf.GGML_QUANT_VERSION = 2) and by ours for every head --------------
KEY_QUANTIZATION_VERSION = "general.quantization_version"
GGML_QUANT_VERSION = 2
