"""``fxtp plan`` (issue 25): a config.json on meta, JSON and table, progress only on a terminal."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest

from fxtp.cli.main import _memory, main
from fxtp.cli.progress import Progress

pytest.importorskip("transformers")

LLAMA31_70B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}
TINY = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128,
    "max_position_embeddings": 64,
}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _config(tmp_path, data) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_plan_a_published_config_as_json(capsys, tmp_path):
    argv = ["plan", _config(tmp_path, LLAMA31_70B), "--devices", "64", "--device-memory", "80GiB", "--batch", "64",
            "--seq", "8192", "--format", "json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    plan = json.loads(out)
    assert plan["mesh"]["tp"] * plan["mesh"]["dp"] == 64 and plan["fits"] and plan["device_memory"] == 80 * 2**30
    assert plan["batch"] == 64 and plan["seq"] == 8192 and plan["analyzed_blocks"] == 2
    assert "fxtp:" not in err  # stderr is not a terminal here: no progress


def test_plan_table_says_micro_batches(capsys, tmp_path):
    """The verdict shows the memory used (its own unit, not the budget's), the table's column
    names micro-batch x accumulation steps, and the step line is in one unit, the total's."""
    argv = ["plan", _config(tmp_path, TINY), "-n", "4", "-m", "1GB", "--batch", "8", "--seq", "64", "--devices-per-node", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "<- chosen" in out and "micro-batch x accumulation" in out
    verdict = next(line for line in out.splitlines() if line.startswith("fits "))
    assert re.match(r"fits 858\.3 MiB \(953\.7 MiB less 95\.4 MiB reserved for the runtime\): uses \d+\.\d (KiB|MiB) per "
                    r"device \(\d+\.\d%\)", verdict), verdict
    step = next(line for line in out.splitlines() if line.startswith("step: "))
    units = set(re.findall(r"\d (s|ms|us)\b", step))
    # the pipelined step adds its stage sends and bubble (NOTE: [pipeline costs])
    assert len(units) == 1 and len(re.findall(r"\d (?:s|ms|us)\b", step)) == (8 if "bubble" in step else 6), step


def test_plan_tp_pins_the_degree(capsys, tmp_path):
    """``--tp`` keeps that degree (the chosen row and the JSON say so); a degree that does not
    divide the devices is a one-line fxtp error with the degrees that do."""
    argv = ["plan", _config(tmp_path, TINY), "-n", "4", "-m", "1GB", "--batch", "8", "--seq", "64", "--devices-per-node", "4"]
    assert main(argv + ["--tp", "4", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mesh"] == {"tp": 4, "dp": 1} and plan["pinned_tp"] == 4
    assert {a["mesh"]["tp"] for a in plan["alternatives"]} == {1, 2, 4}
    assert main(argv + ["--tp", "4"]) == 0
    assert "(tp pinned by the caller)" in capsys.readouterr().out
    assert main(argv + ["--tp", "3"]) != 0
    err = capsys.readouterr().err
    assert "tp=3 does not divide the 4 devices. fix: pin one of 1, 2, 4" in err and "Traceback" not in err
    assert main(argv + ["--tp", "8"]) != 0
    assert "tp=8 is more than the 4 devices" in capsys.readouterr().err


def test_plan_progress_on_a_terminal_only(capsys, tmp_path, monkeypatch):
    argv = ["plan", _config(tmp_path, TINY), "-n", "2", "-m", "8GiB", "--batch", "4", "--seq", "32"]
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(argv) == 0
    lines = terminal.getvalue().splitlines()
    assert [line.split(" took ")[0] for line in lines if " took " in line] == ["fxtp: load model", "fxtp: analyze", "fxtp: search"]
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main(argv + ["--quiet"]) == 0
    assert quiet.getvalue() == ""


def test_progress_is_silent_off_a_terminal():
    stream = io.StringIO()
    progress = Progress(stream=stream)
    progress.stage("capture")
    progress.done()
    assert stream.getvalue() == "" and not progress.enabled


@pytest.mark.parametrize("text, value", [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("1.5 TiB", 3 * 2**39), ("1024", 1024)])
def test_memory_sizes(text, value):
    assert _memory(text) == value


@pytest.mark.parametrize("bad", [["--device-memory", "eighty"], ["--device-memory", "0GiB"], ["--hardware", "tpu"]])
def test_bad_usage_exits_2(tmp_path, bad, capsys):
    argv = ["plan", _config(tmp_path, TINY), "--devices", "2", "--device-memory", "8GiB", *bad]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2


def test_a_model_the_planner_cannot_price_is_an_fxtp_error(capsys):
    assert main(["plan", "mlp", "--devices", "2", "--device-memory", "8GiB", "--batch", "2", "--seq", "4"]) == 1
    assert "no stack of blocks" in capsys.readouterr().err


def test_help_examples_parse(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    examples = [line.strip().split()[1:] for line in out.splitlines() if line.strip().startswith("fxtp plan ")]
    assert len(examples) >= 3 and "micro-batches" in out
    from fxtp.cli.main import get_args_parser

    for argv in examples:
        get_args_parser().parse_args(argv)  # exits 2 on bad usage


def test_times_share_the_unit_of_their_line():
    """``fmt_time(x, like=largest)``: a line's parts in its largest figure's unit; a part too
    small for the unit's two decimals keeps two significant digits instead of reading 0."""
    from fxtp.planner.parallel_plan import fmt_time

    assert [fmt_time(27.7e-6), fmt_time(1.25e-3), fmt_time(1.94), fmt_time(0)] == ["27.7 us", "1.25 ms", "1.94 s", "0.00 s"]
    assert [fmt_time(0, like=27.7e-6), fmt_time(0.02176, like=1.94), fmt_time(0.0043, like=2.0)] == ["0.0 us", "0.02 s", "0.0043 s"]


def _table(out: str) -> list[list[str]]:
    """The plan table's rows, split into columns at the header's dashes."""
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("----"))
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", lines[rule])]
    rows = []
    for line in lines[rule + 1:]:
        if not line.strip() or line.startswith(("skipped", "experts:", "solved")):
            break
        rows.append([line[a:b + 60 if i == len(spans) - 1 else b].strip() for i, (a, b) in enumerate(spans)])
    return rows


def test_plan_reserve_header_and_one_unit_per_column(capsys, tmp_path):
    """Issue 34: a reserve for the runtime (default 10%, --reserve a size or a share) is kept out
    of --device-memory and "fits" means fits the rest; the header shows the memory given, not the
    hardware's; each column of the table, and the reasons, use one unit."""
    argv = ["plan", _config(tmp_path, TINY), "-n", "4", "-m", "1GB", "--batch", "8", "--seq", "64", "--devices-per-node", "4",
            "--hardware", "a100"]
    assert main(argv + ["--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["reserve"] == 10**8 and plan["usable_memory"] == 9 * 10**8
    assert plan["memory_per_device"]["total"] <= plan["usable_memory"]
    assert main(argv + ["--reserve", "0", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["reserve"] == 0
    assert main(argv + ["--reserve", "25%", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["usable_memory"] == 75 * 10**7
    assert main(argv + ["--reserve", "0.25", "--format", "json"]) == 0  # a share, as fxtp.plan(reserve=0.25)
    assert json.loads(capsys.readouterr().out)["usable_memory"] == 75 * 10**7
    assert main(argv + ["--reserve", "512MiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fxtp plan: LlamaForCausalLM on 4 devices of 953.7 MiB (A100-80GB SXM figures, 4 per node)")
    assert "fits 441.7 MiB (953.7 MiB less 512.0 MiB reserved for the runtime): " in out
    rows = _table(out)
    assert len(rows) >= 3
    for column in (7, 8):  # memory, step (after pp, tp, dp, sp, checkpointing, micro-batches, schedule)
        assert len({cell.split()[-1] for cell in [r[column] for r in rows]}) == 1, rows
    sizes = {u for r in rows for u in re.findall(r"\d (GiB|MiB|KiB)\b", r[9])}
    times = {u for r in rows for u in re.findall(r"\d (s|ms|us)\b", r[9])}
    assert sizes <= {rows[0][7].split()[-1]} and times <= {rows[0][8].split()[-1]}, rows
    memory = next(line for line in out.splitlines() if line.startswith("memory per device: "))
    assert len(set(re.findall(r"\d (GiB|MiB|KiB|B)\b", memory))) == 1, memory
    for unclear in ("100%", "4"):  # a share of all, and a bare number: bytes or a share?
        with pytest.raises(SystemExit):
            main(argv + ["--reserve", unclear])
        assert f"invalid reserve '{unclear}'" in capsys.readouterr().err


def test_sizes_share_the_unit_of_their_column():
    from fxtp.planner.parallel_plan import Units, fmt_size

    assert [fmt_size(742.5 * 2**20), fmt_size(742.5 * 2**20, like=40 * 2**30), fmt_size(3 * 2**10, like=2**31)] == [
        "742.5 MiB", "0.7 GiB", "2.9e-06 GiB"]
    units = Units(slowest=1.2, largest=40 * 2**30)
    assert (units.time(0.86187), units.size(2**29)) == ("0.86 s", "0.5 GiB")


def test_plan_tp_overlap_names_the_runtime(capsys, tmp_path):
    """``--tp-overlap`` reaches the plan (its JSON names the runtime priced); another name is bad usage."""
    argv = ["plan", _config(tmp_path, TINY), "-n", "4", "-m", "1GB", "--batch", "8", "--seq", "64", "--devices-per-node", "4",
            "--tp", "4", "--format", "json"]
    assert main(argv + ["--tp-overlap", "megatron"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["tp_overlap"] == "megatron" and plan["step_s"]["tp_comm_hidden"] >= 0 and plan["close_calls"] == []
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--tp-overlap", "nccl"])
    assert exc.value.code == 2 and "invalid choice: 'nccl'" in capsys.readouterr().err
