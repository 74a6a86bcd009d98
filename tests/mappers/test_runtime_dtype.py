"""Mappers compute in fp32 where bf16 would be emulated (a host without native bf16)."""

import torch

from cag.models import registry
from mappers.base import runtime_dtype
from mappers.mot import MoTMapper


def test_bf16_artifacts_compute_in_fp32_on_a_host_without_native_bf16(monkeypatch):
    monkeypatch.setattr(registry, "compute_dtype", lambda: "float32")
    assert runtime_dtype("bfloat16") == torch.float32
    assert runtime_dtype("float16") == torch.float16  # only emulated bf16 is replaced
    assert runtime_dtype("float32") == torch.float32


def test_bf16_artifacts_keep_bf16_where_the_host_computes_in_it(monkeypatch):
    monkeypatch.setattr(registry, "compute_dtype", lambda: "bfloat16")
    assert runtime_dtype("bfloat16") == torch.bfloat16


def test_linear_mappers_use_the_runtime_dtype(monkeypatch, llama, gemma2tok):
    mapper = MoTMapper(llama.fingerprint, gemma2tok.fingerprint, {"compute_dtype": "bfloat16"})
    monkeypatch.setattr(registry, "compute_dtype", lambda: "float32")
    assert mapper.compute_dtype == torch.float32
    monkeypatch.setattr(registry, "compute_dtype", lambda: "bfloat16")
    assert mapper.compute_dtype == torch.bfloat16
