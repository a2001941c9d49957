"""Which dtype a CPU trains and serves in: bf16 only where it has native bf16 instructions (oneDNN's own test also
says yes where bf16 is emulated, and slower than float32), and checkpoints in the dtype the trainer computes in."""

from __future__ import annotations

import torch

from policy import hf


def _cpuinfo(tmp_path, flags: str, key: str = "flags"):
    f = tmp_path / "cpuinfo"
    f.write_text(f"processor\t: 0\nmodel name\t: some cpu\n{key}\t\t: {flags}\n\nprocessor\t: 1\n{key}\t\t: other\n")
    return str(f)


def test_cpu_flags_are_the_first_processors(tmp_path):
    assert hf.cpu_flags(_cpuinfo(tmp_path, "fpu avx2 avx512f avx512_bf16")) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert hf.cpu_flags(_cpuinfo(tmp_path, "fp asimd bf16", key="Features")) == {"fp", "asimd", "bf16"}
    assert hf.cpu_flags(str(tmp_path / "absent")) is None


def test_native_bf16_is_a_flag_not_plain_avx512(tmp_path):
    emulated = hf.cpu_flags(_cpuinfo(tmp_path, "avx2 avx512f avx512bw avx512vl avx512_vnni"))
    assert not emulated & hf.NATIVE_BF16_FLAGS  # an Ice Lake Xeon: oneDNN says yes, bf16 GEMMs are slower
    for native in ("avx512f avx512_bf16", "amx_tile amx_bf16", "fp asimd bf16"):
        assert hf.cpu_flags(_cpuinfo(tmp_path, native)) & hf.NATIVE_BF16_FLAGS


def test_checkpoints_are_served_in_the_dtype_the_trainer_computes_in():
    assert hf.served_dtype("cuda") == torch.bfloat16
    assert hf.served_dtype("cpu") == (torch.bfloat16 if hf.cpu_bf16() else torch.float32)
