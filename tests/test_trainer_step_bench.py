"""The trainer_step benchmark's profile of a pass (``benchmarks/trainer_step.py`` ``--profile``): which kind each
op is counted as, and that a real pass's time lands in those kinds; its figures are in benchmarks/RESULTS.md."""

from __future__ import annotations

from benchmarks import trainer_step


def test_ops_are_counted_by_kind():
    kind = trainer_step.op_kind
    assert kind("aten::mm") == kind("aten::bmm") == "matmul"
    assert kind("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert kind("aten::copy_") == kind("aten::_to_copy") == "casts"
    assert kind("aten::_fused_adamw_") == "optimizer"
    assert kind("aten::silu_backward") == kind("aten::mul") == "other"


def test_a_profiled_pass_puts_its_matmuls_attention_and_casts_where_they_belong():
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    # large enough that each kind takes milliseconds (the breakdown is rounded to 0.1 ms)
    w = torch.randn(512, 512, requires_grad=True)
    x = torch.randn(8, 256, 512)

    def step() -> float:
        h = (x @ w).view(8, 256, 8, 64).transpose(1, 2)
        o = F.scaled_dot_product_attention(h, h, h, is_causal=True)
        loss = o.to(torch.float64).sum()
        loss.backward()
        return float(loss.detach())

    out, found = trainer_step.profiled(step)
    assert isinstance(out, float) and w.grad is not None
    spent = found["self_cpu_s"]
    assert spent["matmul"] > 0 and spent["attention"] > 0 and spent["casts"] > 0
    assert found["wall_s"] > 0 and found["top"] and all(t["calls"] >= 1 for t in found["top"])
    assert sum(spent.values()) <= found["wall_s"] * torch.get_num_threads() + 0.05  # self times do not double count
