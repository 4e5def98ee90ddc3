"""benchmarks/gpu/step_profile.py reads Nsight Compute's CSV in both of its layouts.

The device check (benchmarks/gpu/check.sh) turns ncu's per-kernel measurements of one
decode step into a table; that run happens on a lent GPU with no second chance, so the
reading is checked here on text of the shape ncu writes: `--page raw` (a row per launch,
a units row under the header, scaled units, thousands separators) and `--page details`
(a row per metric), with ncu's own banner lines before the header.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
step_profile = pytest.importorskip("step_profile")

RAW = '''==PROF== Connected to process 4242 (/usr/bin/python3.12)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"
"","","","","","","","","","","","Mbyte","Kbyte","usecond"
"0","4242","python3.12","h","mmv_qkv_rope_q4_1","1","13","(256, 1, 1)","(60, 1, 1)","0","9.0","1.25","2.5","2.00"
"1","4242","python3.12","h","attn_decode_bf16","1","13","(128, 1, 1)","(9, 1, 1)","0","9.0","0.05","0","3.50"
"2","4242","python3.12","h","mmv_qkv_rope_q4_1","1","13","(256, 1, 1)","(60, 1, 1)","0","9.0","1,250","","2"
'''

DETAILS = '''"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","p","h","mmv3_bf16","1","13","(256, 1, 1)","(128, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","8,388,608"
"0","1","p","h","mmv3_bf16","1","13","(256, 1, 1)","(128, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","2,500"
"1","1","p","h","sample_rows","1","13","(1024, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","4.5"
'''


def test_raw_page_with_units_row_and_separators() -> None:
    launches = step_profile.read_ncu_csv(RAW.splitlines())
    assert [x["kernel"] for x in launches] == ["mmv_qkv_rope_q4_1", "attn_decode_bf16", "mmv_qkv_rope_q4_1"]
    first, _, third = launches
    assert first["dram__bytes_read.sum"] == pytest.approx(1.25e6)
    assert first["dram__bytes_write.sum"] == pytest.approx(2.5e3)
    assert first["gpu__time_duration.sum"] == pytest.approx(2e-6)
    assert third["dram__bytes_read.sum"] == pytest.approx(1.25e9)   # "1,250" Mbyte
    assert third["dram__bytes_write.sum"] == 0.0                     # blank: not collected


def test_details_page_one_row_per_metric() -> None:
    launches = step_profile.read_ncu_csv(DETAILS.splitlines())
    assert len(launches) == 2
    assert launches[0] == {"kernel": "mmv3_bf16", "dram__bytes_read.sum": 8388608.0,
                           "gpu__time_duration.sum": pytest.approx(2.5e-6)}
    assert launches[1]["gpu__time_duration.sum"] == pytest.approx(4.5e-6)


def test_summary_groups_launches_by_kernel() -> None:
    table = step_profile.summarize(step_profile.read_ncu_csv(RAW.splitlines()))
    lines = table.splitlines()
    assert lines[2].startswith("| mmv_qkv_rope_q4_1 | 2 | 4.0 | 2.00 |")
    assert lines[3].startswith("| attn_decode_bf16 | 1 | 3.5 | 3.50 | 0.05 |")
    assert lines[-1].startswith("| **all** | 3 | 7.5 |")
    assert "| 53% |" in lines[2]   # share of the step's kernel time: 4.0 of 7.5


def test_text_without_a_header_says_so() -> None:
    with pytest.raises(ValueError, match="Kernel Name"):
        step_profile.read_ncu_csv(["==PROF== Disconnected", "==ERROR== no kernels were profiled"])


device_figures = pytest.importorskip("device_figures")


def test_summary_fractions_are_of_the_measured_bandwidth() -> None:
    """The "% of HBM" column is of the GPU's own copy bandwidth (device_figures.py), which
    differs between the H100 and the H200 the check may be lent."""
    launches = step_profile.read_ncu_csv(RAW.splitlines())
    attn = [x for x in launches if x["kernel"] == "attn_decode_bf16"][0]
    rate = attn["dram__bytes_read.sum"] / attn["gpu__time_duration.sum"]   # 0.05 MB in 3.5 µs
    line = step_profile.summarize(launches, hbm_bytes_per_s=rate).splitlines()[3]
    assert line.startswith("| attn_decode_bf16 |") and "| 100% |" in line, line
    assert "| 50% |" in step_profile.summarize(launches, hbm_bytes_per_s=2 * rate).splitlines()[3]


def test_device_figures_read_back_or_stand_in(tmp_path: Path) -> None:
    assumed = device_figures.figures(None, None)
    assert assumed["measured"] is False and "assumed, not measured" in device_figures.describe(assumed)
    path = tmp_path / "device.json"
    path.write_text('{"name": "NVIDIA H100 80GB HBM3", "hbm_bytes_per_s": 3.0e12, '
                    '"bf16_peak_flops": 7.0e14, "measured": true}')
    fig = device_figures.figures(path)
    assert fig["hbm_bytes_per_s"] == 3.0e12
    assert "H100" in device_figures.describe(fig) and "3.00 TB/s" in device_figures.describe(fig)
    assert "700 TFLOP/s (measured here)" in device_figures.describe(fig)


def test_device_figures_measure_with_torch() -> None:
    """measure()'s arithmetic, run with torch on the CPU at small sizes (on the GPU machine
    the same code times 1 GiB copies and 8192^3 bf16 products with CUDA events)."""
    import json
    import subprocess

    from ref_python import ref_python
    here = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
    code = ("import json, sys, torch; sys.path.insert(0, sys.argv[1]); import device_figures as d; "
            "print(json.dumps(d.measure(torch, 'cpu', copy_bytes=1 << 22, n=128, rounds=2, reps=3)))")
    proc = subprocess.run([ref_python(), "-c", code, str(here)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fig = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fig["measured"] is True and fig["name"] == "cpu"
    assert 1e8 < fig["hbm_bytes_per_s"] < 1e13 and 1e7 < fig["bf16_peak_flops"] < 1e14, fig
