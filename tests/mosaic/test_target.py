import json

import pytest

from mosaic import target


def test_kinds():
  assert target.kind_of("cpu", None) == "cpu"
  assert target.kind_of("gpu", "9.0") == "hopper"
  assert target.kind_of("gpu", "10.0") == "blackwell"
  assert target.kind_of("gpu", "8.0") == "cuda"


def test_datasheet_and_calibration(tmp_path, monkeypatch):
  monkeypatch.setattr(target, "CALIBRATION_DIR", tmp_path)  # ignore committed files
  t = target.make("gpu", "NVIDIA H200", "9.0")
  assert t.kind == "hopper" and t.ceilings.sms == 132 and t.ceilings.source == "datasheet"
  cal = tmp_path / "cal.json"
  cal.write_text(json.dumps({"bf16_tflops": 790, "hbm_gbps": 4300, "sms": 132,
                             "smem_per_block": 232448}))
  monkeypatch.setenv("MOSAIC_CALIBRATION", str(cal))
  t = target.make("gpu", "NVIDIA H200", "9.0")
  assert t.ceilings.hbm_gbps == 4300 and t.ceilings.source.startswith("measured")
  cal.write_text(json.dumps({"bf16_tflops": 790}))
  with pytest.raises(ValueError, match="malformed"):
    target.make("gpu", "NVIDIA H200", "9.0")


def test_current_is_cpu_here():
  t = target.current()
  assert t.kind in target.KINDS
  assert t.key == target.device_key(t.name)


def test_bad_values():
  with pytest.raises(ValueError, match="hbm_gbps"):
    target.Ceilings(1.0, 0.0, 1, 1)
  with pytest.raises(ValueError, match="kind"):
    target.Target("tpu", "x", None, target.Ceilings(1, 1, 1, 1))
