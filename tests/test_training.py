"""End-to-end gate: a transformers Llama built from a config, trained plainly on real text made on
this machine (the Python standard library's own source, as bytes), then trained on with every GEMM
checked (``protect`` + ``checked``, attention products included) and every product's output and
operand carried to its death (``OutputCheck``) in float32, bf16 autocast and fp16 with
GradScaler, with AdamW and gradient clipping: no alarm, every GEMM counted."""
import os
import sysconfig

import pytest
import torch

import abft

transformers = pytest.importorskip("transformers")


def corpus(n_files=60):
    """The first ``n_files`` modules of the standard library, as a tensor of bytes."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(f for f in os.listdir(root) if f.endswith(".py"))[:n_files]
    data = b"".join(open(os.path.join(root, f), "rb").read() for f in names)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def llama(width, layers, heads, kv_heads, ffn, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=ffn,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, max_position_embeddings=256,
                                   attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg)


def batches(data, batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    while True:
        i = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        yield torch.stack([data[j:j + seq] for j in i.tolist()])


def train(model, data, steps, *, batch, seq, seed, mode="fp32", checked=False, lr=3e-3):
    """``steps`` AdamW steps with gradient clipping; ``mode``: fp32, bf16 (autocast) or fp16
    (autocast and GradScaler). Returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=mode == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)
    it = batches(data, batch, seq, seed)
    losses = []
    for step in range(steps):
        x = next(it)
        with abft.scope(step=step), (abft.checked(model) if checked else _null()), \
                (abft.OutputCheck(model=model) if checked else _null()):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = model(input_ids=x, labels=x).loss
            opt.zero_grad()
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _gate(model, data, modes, steps, *, batch, seq, layers):
    summary = abft.protect(model)
    assert len(summary["linear"]) == 7 * layers + 1 and summary["not_covered"] == []
    for n, mode in enumerate(modes):
        abft.reset()
        losses = train(model, data, steps, batch=batch, seq=seq, seed=100 + n, mode=mode, checked=True)
        alarms = abft.flush()
        assert alarms == [], f"{mode}: {alarms[0]}"
        cov = {(r["op"], r["module"]): r for r in abft.coverage()}
        assert all(r["unprotected"] == 0 for r in cov.values())
        linears = [k for k in cov if k[0] == "linear"]
        attn = [k for k in cov if k[0] == "matmul" and k[1].endswith("self_attn")]
        assert len(linears) == 7 * layers + 1 and len(attn) == layers
        # forward, grad_input, grad_weight per linear; forward, grad_a, grad_b per attention product
        assert all(cov[k]["checked"] == 3 * steps for k in linears), mode
        assert all(cov[k]["checked"] == 2 * 3 * steps for k in attn), mode
        s = abft.stats()
        assert s.get("alarms", 0) == 0 and s.get("unverified_calls", 0) == 0, (mode, s)
        total = sum(r["checked"] for r in cov.values())
        print(f"{mode}: {steps} steps, {total} checked GEMMs, 0 alarms, loss {losses[0]:.3f} -> "
              f"{losses[-1]:.3f}, worst clean ratio {abft.stats()['margins'][0]['worst']:.3f}")


def test_llama_trains_with_every_gemm_checked_and_no_alarm():
    data = corpus()
    model = llama(width=96, layers=2, heads=4, kv_heads=2, ffn=256)
    losses = train(model, data, 150, batch=16, seq=64, seed=0)
    assert losses[-1] < 0.7 * losses[0]                   # it learned something from the text
    _gate(model, data, ("fp32", "bf16", "fp16"), 8, batch=16, seq=64, layers=2)


@pytest.mark.slow          # about 5 minutes under the interpreter on 2 cores
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "") in ("", "0") and not torch.cuda.is_available(),
                    reason="needs TRITON_INTERPRET=1 or a GPU")
def test_llama_on_the_fused_kernel_has_no_alarm():
    pytest.importorskip("triton")
    data = corpus(20)
    model = llama(width=32, layers=1, heads=1, kv_heads=1, ffn=64)
    train(model, data, 150, batch=4, seq=32, seed=0)
    with abft.config(backend="triton"):
        _gate(model, data, ("fp32", "bf16", "fp16"), 8, batch=2, seq=16, layers=1)
