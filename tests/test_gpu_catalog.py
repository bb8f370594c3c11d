"""The GPU catalogue: the default table, a user's overrides field by field, ``--gpu-types`` selections, and
errors that name the field path."""

from __future__ import annotations

import pytest
import yaml

from planner import analytical
from planner.gpu_catalog import CatalogError, default_catalog, load_catalog

NEW_TYPE = {"memory_mib": 98304, "hbm_bandwidth_gb_s": 4000, "bf16_tflops": 500, "link_bandwidth_gb_s": 400,
            "link": "NVLink", "collective_latency_us": 10, "spec_source": "a test", "ray_accelerator_type": "X1",
            "price_per_gpu_hour": 2.5}


def _write(tmp_path, gpus: dict) -> str:
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump({"gpus": gpus}))
    return str(path)


def test_default_catalogue_has_priced_types_with_two_sources():
    cat = default_catalog()
    assert {"H100-80GB-SXM", "H200-141GB", "A100-80GB-SXM", "L40S", "L4"} <= set(cat.names)
    for t in cat.types:
        assert t.price_per_gpu_hour > 0 and len(t.price_sources) >= 2, t.name
        assert all("20" in s for s in t.price_sources)  # every source carries its date
        assert t.ray_resource == f"accelerator_type:{t.ray_accelerator_type}"
    assert analytical.GPUS == cat.specs()  # the analytical profiles read the same specs
    assert cat.get("h100").name == "H100-80GB-SXM" and cat.get("A100").name == "A100-80GB-SXM"


def test_user_file_overrides_field_by_field_and_adds_types(tmp_path):
    cat = load_catalog(_write(tmp_path, {"H100": {"price_per_gpu_hour": 4.0, "max_gpus": 16}, "X1": NEW_TYPE}))
    h100 = cat.get("H100-80GB-SXM")
    assert h100.price_per_gpu_hour == 4.0 and h100.max_gpus == 16
    assert h100.spec == default_catalog().get("H100").spec  # untouched fields keep the default
    assert cat.get("x1").spec.memory_bytes == 98304 * 2**20 and cat.get("X1").price_per_gpu_hour == 2.5


@pytest.mark.parametrize("gpus, message", [
    ({"X1": {k: v for k, v in NEW_TYPE.items() if k != "memory_mib"}}, "gpus.X1.memory_mib: required"),
    ({"L4": {"price_per_gpu_hour": -1}}, "gpus.L4.price_per_gpu_hour: must be > 0, got -1"),
    ({"L4": {"price_per_gpu_hour": "cheap"}}, "gpus.L4.price_per_gpu_hour: must be a number, got 'cheap'"),
    ({"L4": {"max_gpus": 0}}, "gpus.L4.max_gpus: must be an integer >= 1, got 0"),
    ({"L4": {"colour": "green"}}, "gpus.L4.colour: unknown field; allowed: memory_mib"),
    ({"L4": {"aliases": ["H100"]}}, "gpus.L4.aliases: 'H100' also names H100-80GB-SXM"),
    ({"L4": {"price_sources": "aws"}}, "gpus.L4.price_sources: must be a list of strings"),
])
def test_bad_catalogue_fields_are_named(tmp_path, gpus, message):
    with pytest.raises(CatalogError) as err:
        load_catalog(_write(tmp_path, gpus))
    assert str(err.value).startswith(message), str(err.value)


def test_gpu_types_selection():
    cat = default_catalog().select("H100:4.0,A100:1.8:16,L4")
    assert cat.names == ["H100-80GB-SXM", "A100-80GB-SXM", "L4"]
    assert cat.get("H100").price_per_gpu_hour == 4.0 and cat.get("A100").max_gpus == 16
    assert cat.get("L4").price_per_gpu_hour == default_catalog().get("L4").price_per_gpu_hour
    for text, message in (("B200", "--gpu-types: unknown GPU type 'B200'; known: H100-80GB-SXM (H100)"),
                          ("H100:free", "--gpu-types H100:free: price: must be a number"),
                          ("H100:2:0", "--gpu-types H100:2:0: max GPUs: must be an integer >= 1"),
                          ("H100,h100", "--gpu-types: H100-80GB-SXM is named twice"),
                          ("H100:1:2:3", "--gpu-types: expected NAME[:PRICE[:MAX_GPUS]] items")):
        with pytest.raises(CatalogError) as err:
            default_catalog().select(text)
        assert str(err.value).startswith(message), str(err.value)
