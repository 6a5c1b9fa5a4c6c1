"""data.max_tokens: auto (scaletrain/models/memory.py): the activation estimate against the bytes a training
forward really keeps for its backward, the sizing with injected device memories, and the resolution into
the config (once, recorded like engine.precision: auto)."""
from __future__ import annotations

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.errors import ScaletrainError
from scaletrain.models import build_model
from scaletrain.models.loss import label_smoothed_ce
from scaletrain.models.memory import CPU_AUTO_TOKENS, apply_max_tokens, auto_max_tokens, training_memory
from scaletrain.vocab import PAD

V = 268
GiB = 2**30
SMALL = ["model.kernels=torch", "model.max_positions=128", "data.max_bytes=100", "data.max_tokens=2000"]


def saved_bytes(model, B: int, S: int, T: int, precision: str) -> int:
    """Bytes of the tensors a training forward (and the loss) keeps for the backward, parameters excluded."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, 260, (B, S), generator=g)
    tgt = torch.randint(4, 260, (B, T + 1), generator=g)
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(src, tgt[:, :-1])
        label_smoothed_ce(logits.float(), tgt[:, 1:], epsilon=0.1, ignore_index=PAD)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("recipe,d", [("base", 128), ("moe_base", 128), ("moce_d5", 128), ("embeddingless", 272)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_estimate_covers_what_the_backward_keeps(recipe, d, precision):
    """Per padded token (the slope between batches of 2 and 4 rows), for a balanced and two lopsided
    source/target splits: the estimate is at least the measurement and at most 1.3x it (measured 1.09-1.25x
    with the 8% margin; one CPU kept 1.04x the unmargined count for embeddingless bf16)."""
    cfg = load_config(recipe, [f"model.d_model={d}", "model.ffn_dim=512"] + SMALL)
    torch.manual_seed(0)
    model = build_model(cfg.model, V, moe=cfg.moe).train()
    worst = max((saved_bytes(model, 4, S, T, precision) - saved_bytes(model, 2, S, T, precision)) / (2 * (S + T))
                for S, T in ((32, 32), (4, 60), (60, 4)))
    per_token = training_memory(cfg.model, V, precision, cfg.moe)[1]
    assert worst <= per_token <= 1.3 * worst, (worst, per_token)


def test_budget_grows_with_memory_and_shrinks_with_model_and_precision():
    base, moe, sub = load_config("base"), load_config("moe_base"), load_config("subword_base")
    b = {gb: auto_max_tokens(base.model, 360, "bf16", gb * GiB)[0] for gb in (16, 24, 80)}
    assert b[16] < b[24] < b[80] and all(v % 256 == 0 for v in b.values())
    assert auto_max_tokens(base.model, 360, "fp32", 80 * GiB)[0] < b[80]  # 4-byte activations
    assert auto_max_tokens(moe.model, 360, "bf16", 80 * GiB, moe.moe)[0] < b[80]  # top-2 experts, 3x the weights
    assert auto_max_tokens(sub.model, 30100, "bf16", 80 * GiB)[0] < b[80]  # 30k logits per target token
    fixed, per_token = training_memory(base.model, 360, "bf16")
    assert fixed == 44_322_816 * 18  # weights + gradients + AdamW state, mixed precision
    tokens, why = auto_max_tokens(base.model, 360, "bf16", 80 * GiB)
    assert tokens == int((0.75 * 80 * GiB - GiB - fixed) // per_token) // 256 * 256
    assert "80.0 GiB device, bf16" in why
    assert auto_max_tokens(base.model, 360, "bf16", None) == (CPU_AUTO_TOKENS, auto_max_tokens(
        base.model, 360, "bf16", None)[1])


def test_a_model_that_does_not_fit_is_one_clear_error():
    cfg = load_config("moe_base")
    with pytest.raises(ScaletrainError, match=r"^data.max_tokens=auto: the model does not fit this device") as e:
        auto_max_tokens(cfg.model, 360, "fp32", 2 * GiB, cfg.moe, min_tokens=2047)
    assert "\n" not in str(e.value)


def test_auto_resolves_once_into_the_config():
    cfg = load_config("base", ["data.max_tokens=auto"])
    assert cfg.data.max_tokens == "auto"
    tokens = apply_max_tokens(cfg, 360, total_memory=24 * GiB)
    assert cfg.data.max_tokens == tokens and cfg.data.max_tokens_auto.startswith(f"{tokens}: 24.0 GiB device")
    assert apply_max_tokens(cfg, 360, total_memory=80 * GiB) == tokens  # resolved: left as it is
    cpu = load_config("base", ["data.max_tokens=auto"])
    assert apply_max_tokens(cpu, 360, device=torch.device("cpu")) == CPU_AUTO_TOKENS
    assert cpu.data.max_tokens_auto.startswith(f"{CPU_AUTO_TOKENS}: CPU")
    fixed = load_config("base", ["data.max_tokens=9000"])
    assert apply_max_tokens(fixed, 360, total_memory=80 * GiB) == 9000 and fixed.data.max_tokens_auto == ""
    with pytest.raises(ScaletrainError, match="data.max_tokens"):
        load_config("base", ["data.max_tokens=lots"])
