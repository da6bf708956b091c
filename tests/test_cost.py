"""The price table and the arithmetic of what training costs."""

import pytest

from shardline.core import cost


def test_device_names_map_to_the_tables_types():
    assert cost.gpu_type("NVIDIA H100 80GB HBM3") == "H100"
    assert cost.gpu_type("NVIDIA H200") == "H200"
    assert cost.gpu_type("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert cost.gpu_type("NVIDIA A100-SXM4-40GB") == "A100-40GB"
    assert cost.gpu_type("NVIDIA A10G") == "A10G"
    assert cost.gpu_type("NVIDIA A10") == "A10"
    assert cost.gpu_type("NVIDIA L4") == "L4" and cost.gpu_type("NVIDIA L40S") == "L40S"
    assert cost.gpu_type("Tesla T4") == "T4" and cost.gpu_type("NVIDIA GeForce RTX 4090") == "RTX4090"
    assert cost.gpu_type("cpu") == "CPU"
    assert cost.gpu_type("Radeon Pro W7900") == "RADEON PRO W7900"  # unknown: kept, for the user's own table


def test_the_shipped_table_is_an_estimate_with_its_date_and_every_type_has_a_price():
    table = cost.load_prices()
    assert "estimate" in table.as_of and "2025" in table.as_of
    assert {"H100", "A100-80GB", "L4", "T4", "CPU"} <= set(table.gpus)
    for gpu in table.gpus:
        assert all(p.on_demand > 0 and (p.spot is None or p.spot < p.on_demand) for p in table.of(gpu)), gpu


def test_an_estimate_is_hours_times_the_rate_per_provider(tmp_path, monkeypatch):
    own = tmp_path / "prices.yaml"
    own.write_text(
        "as_of: '2026-11 our contract'\nprices:\n"
        "  - {gpu: H100, provider: aws, on_demand: 4.00, spot: 1.50}\n"
        "  - {gpu: MI300X, provider: neo, on_demand: 3.00, spot: null}\n"
    )
    monkeypatch.setenv(cost.PRICES_ENV, str(own))
    table = cost.load_prices()
    assert "our contract" in table.as_of and str(own) in table.sources[0]
    aws = [p for p in table.of("H100") if p.provider == "aws"]
    assert len(aws) == 1 and aws[0].on_demand == 4.0  # replaced, not added twice
    assert any(p.provider == "lambda" for p in table.of("H100"))  # the shipped rest stays
    rows = {r["provider"]: r for r in cost.estimate(2.5, "H100", table, spot=True, gpus=2)}
    assert rows["aws"]["usd"] == pytest.approx(2.5 * 2 * 1.5) and rows["aws"]["gpu_hours"] == 5.0
    assert rows["lambda"]["usd"] is None  # no spot there: said, not priced as zero
    assert cost.estimate(1.0, "MI300X", table)[0]["usd"] == 3.0


def test_an_unknown_gpu_type_or_a_bad_prices_file_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"GPU type 'B200' is not in the price table .*known types: .*H100"):
        cost.load_prices().of("B200")
    bad = tmp_path / "bad.yaml"
    bad.write_text("prices:\n  - {gpu: H100, provider: aws}\n")
    with pytest.raises(ValueError, match=r"bad.yaml: entry 1 .* needs gpu, provider, on_demand"):
        cost.load_prices(bad)
    monkeypatch.setenv(cost.PRICES_ENV, str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match=r"missing.yaml \(from SHARDLINE_PRICES\) does not exist"):
        cost.load_prices()


def test_the_gpu_type_is_declared_detected_or_cpu(monkeypatch):
    monkeypatch.setenv(cost.GPU_ENV, "NVIDIA L4")
    assert cost.detect_gpu() == ("L4", "SHARDLINE_GPU_TYPE=NVIDIA L4")
    monkeypatch.delenv(cost.GPU_ENV)
    gpu, how = cost.detect_gpu()
    import torch

    if not torch.cuda.is_available():
        assert gpu == "CPU" or how.startswith("nvidia-smi")
