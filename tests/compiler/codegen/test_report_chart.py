"""The placement report's bar charts: memory and parameters per device, as the table says."""

from __future__ import annotations

import re

import pytest

from helpers import EXAMPLES, write_spec
from mpgen.compiler import driver as build
from mpgen.compiler.codegen.report import BYTE_UNITS, _axis_top

UNIT_BYTES = {name: 1024 ** k for k, name in enumerate(BYTE_UNITS)}


def device_rows(report: str) -> dict[str, tuple[int, float]]:
    """Device -> (parameters, memory in bytes as the table shows it) from the device table."""
    lines = report.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| device | layers |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    rows = {}
    for line in lines[header + 2:]:
        if not line.startswith("| `"):
            break
        cells = dict(zip(columns, (c.strip() for c in line.strip("|").split("|"))))
        amount, unit = cells["memory"].split()
        rows[cells["device"].strip("`")] = (int(cells["parameters"].replace(",", "")),
                                            float(amount) * UNIT_BYTES[unit])
    return rows


def charts(report: str) -> dict[str, dict]:
    """Title -> the chart's axis unit, devices and bar values."""
    found = {}
    for body in re.findall(r"```mermaid\nxychart-beta\n(.*?)```", report, re.S):
        title = re.search(r'^  title "(.*)"$', body, re.M).group(1)
        labels = re.search(r"^  x-axis \[(.*)\]$", body, re.M).group(1)
        axis, top = re.search(r'^  y-axis "(.*)" 0 --> (\S+)$', body, re.M).groups()
        bars = re.search(r"^  bar \[(.*)\]$", body, re.M).group(1)
        found[title] = {"axis": axis, "top": float(top),
                        "devices": [d.strip().strip('"') for d in labels.split(",")],
                        "values": [float(v) for v in bars.split(",")]}
    return found


def check_against_table(report: str, memory_title: str, params_title: str) -> None:
    rows = device_rows(report)
    drawn = charts(report)
    assert set(drawn) == {memory_title, params_title}
    memory, params = drawn[memory_title], drawn[params_title]
    assert memory["devices"] == params["devices"] == list(rows)
    scale = UNIT_BYTES[memory["axis"]]
    for device, value in zip(memory["devices"], memory["values"]):
        shown = rows[device][1]  # rounded to 0.1 of its own unit in the table
        unit = next(u for u in reversed(BYTE_UNITS) if shown >= UNIT_BYTES[u] or u == "B")
        assert abs(value * scale - shown) <= 0.05 * scale + 0.05 * UNIT_BYTES[unit]
        assert value <= memory["top"]
    count = {"parameters": 1, "thousands": 10 ** 3, "millions": 10 ** 6}[params["axis"]]
    digits = 0 if count == 1 else 2
    for device, value in zip(params["devices"], params["values"]):
        assert value == round(rows[device][0] / count, digits)
        assert value <= params["top"]


@pytest.mark.slow  # 4 s: too long for the quick loop
def test_gpt2_report_charts_memory_and_parameters_as_in_the_table():
    report = build.generate(EXAMPLES / "gpt2_auto.yaml").files["gpt2_auto.placement.md"]
    check_against_table(report, "Estimated training memory per device in MiB",
                        "Parameters per device in millions")
    # The exact text: the table's own numbers where the units agree.
    assert ("```mermaid\n"
            "xychart-beta\n"
            '  title "Estimated training memory per device in MiB"\n'
            '  x-axis ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]\n'
            '  y-axis "MiB" 0 --> 800\n'
            "  bar [601.0, 669.7, 669.7, 601.6]\n"
            "```\n\n"
            "```mermaid\n"
            "xychart-beta\n"
            '  title "Parameters per device in millions"\n'
            '  x-axis ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]\n'
            '  y-axis "millions" 0 --> 50\n'
            "  bar [39.38, 42.53, 42.53, 38.60]\n"
            "```\n") in report
    # Right after the device table, before the transfers.
    table_end = report.index("| total |")
    assert table_end < report.index("xychart-beta") < report.index("## Transfers")


def test_small_model_charts_in_kib_and_plain_counts():
    report = build.generate(EXAMPLES / "seed.yaml").files["simple_model.placement.md"]
    check_against_table(report, "Estimated training memory per device in KiB",
                        "Parameters per device")
    assert '  bar [220, 210]\n' in report


def test_an_empty_device_and_mixed_units_chart_on_one_scale(tmp_path):
    # A large layer, a tiny one and an empty device: the table shows MiB, KiB and B;
    # the chart, MiB for all three.
    path = write_spec(tmp_path, """
        mpgen: 1
        name: Mixed
        inputs:
          x: [batch, 1024]
        layers:
          big: {op: Linear, args: [1024, 1024]}
          small: {op: ReLU}
        placement:
          auto: {devices: [cuda:0, cuda:1, cuda:2]}
        train: {batch_size: 2}
    """)
    report = build.generate(path).files["mixed.placement.md"]
    rows = device_rows(report)
    assert list(rows) == ["cuda:0", "cuda:1", "cuda:2"] and rows["cuda:2"] == (0, 0.0)
    check_against_table(report, "Estimated training memory per device in MiB",
                        "Parameters per device in millions")
    drawn = charts(report)["Estimated training memory per device in MiB"]
    assert drawn["values"][2] == 0.0


@pytest.mark.parametrize("value, top", [(0, "1"), (669.7, "800"), (42.53, "50"), (2.2, "2.5"),
                                        (210, "250"), (1, "1"), (0.004, "0.004"),
                                        (8.01, "10"), (120, "120")])
def test_axis_tops_are_round(value, top):
    assert _axis_top(value) == top
