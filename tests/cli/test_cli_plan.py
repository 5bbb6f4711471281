"""``autotp plan``: one process, meta tensors, no process group; and the report's numbers."""
from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from autotp.capture.tracer import capture
from autotp.cli.main import app
from autotp.plan.planner import make_plan
from autotp.reports.sharding import build_report
from autotp.reports.symbols import display, symbol_roles
from ranks import ROOT

NANOGPT = os.path.join(ROOT, "examples", "nanogpt.py")
runner = CliRunner()
WIDE = {"COLUMNS": "240"}  # one table row per line, so the assertions can read rows


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "2", "--json", str(out / "out.json"),
                                 "--svg", str(out / "out.svg"), "--html", str(out / "out.html")], env=WIDE)
    return out, result


def _row(output: str, module: str) -> str:
    return next(line for line in output.splitlines() if f" {module} " in line)


def test_plan_nanogpt_tp2(planned) -> None:
    out, result = planned
    assert result.exit_code == 0, result.output
    data = json.loads((out / "out.json").read_text())
    assert data["plan"]["version"] == 14 and data["plan"]["tp"] == 2
    # the completeness check: the one weight every rank holds whole is the position embedding, with why
    assert [w["name"] for w in data["plan"]["whole"]] == ["transformer.wpe.weight"]
    assert "not sharded: 1 weight(s) every rank holds whole" in result.stdout
    assert len(data["plan"]["pairs"]) == 4
    assert data["layout"]["tp"] == [[0, 1]]
    assert (out / "out.svg").read_text().startswith("<svg")
    assert "<html" in (out / "out.html").read_text().lower()
    text = result.stdout
    assert "column" in _row(text, "transformer.h.0.attn.c_attn")
    assert "row" in _row(text, "transformer.h.0.attn.c_proj")
    assert "vocab" in _row(text, "lm_head") and "vocab" in _row(text, "transformer.wte")
    # c_attn's weight [192, 64] holds q|k|v: each rank keeps half of each, 96 rows
    assert "[192, 64]" in _row(text, "transformer.h.0.attn.c_attn") and "[96, 64]" in _row(
        text, "transformer.h.0.attn.c_attn")


def test_plan_communication_matches_formula(planned) -> None:
    out, result = planned
    assert result.exit_code == 0, result.output
    total = next(line for line in result.stdout.splitlines() if line.startswith("│ total "))
    assert total.count("1.00") == 2  # count ratio and elements ratio
    comm = {(c["direction"], c["op"]): c for c in json.loads((out / "out.json").read_text())["report"]["comm"]}
    b, s, h, L = 4, 32, 64, 2  # examples/nanogpt.py's example batch and config
    assert comm[("forward", "sum")]["elements"] == 2 * L * b * s * h + b * s * h + 2 * b * s
    assert comm[("backward", "sum")]["elements"] == 2 * L * b * s * h + b * s * h
    assert comm[("forward", "max")]["count"] == 1
    assert comm[("total", "all")]["count_ratio"] == 1.0 and comm[("total", "all")]["elements_ratio"] == 1.0


def test_report_memory_counts_tied_weight_once() -> None:
    from nanogpt import GPT, GPTConfig, example_batch

    with torch.device("meta"):
        model = GPT(GPTConfig())
    plan = make_plan(capture(model, example_batch(), {})[0], 2)
    report = build_report(plan, model.named_parameters(remove_duplicate=False), 8, 64)
    unique = {id(p): p for p in model.parameters()}.values()
    assert report.memory.params == sum(p.numel() for p in unique)
    tied = next(r for r in report.params if len(r.aliases) == 2)
    assert tied.role == "vocab" and set(tied.aliases) == {"transformer.wte.weight", "lm_head.weight"}
    # vocab 256 splits evenly, so the rule 16·P_sharded/t + 16·P_replicated is exact
    assert report.memory.formula_ratio == 1.0
    assert report.memory.train_bytes_per_rank == 16 * report.memory.local
    roles = symbol_roles(plan)
    assert sorted(roles.values()) == ["b", "s"]
    assert {c.shape for c in report.collectives} == {"b×s×64", "b·s"}
    assert display(("7", "3"), roles) == "7×3"
    assert report.batch == 8 and report.seq == 64 and report.hidden == 64


def test_heads_not_divisible_exits_2(tmp_path) -> None:
    model = tmp_path / "three_heads.py"
    model.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(ROOT, "examples")!r})
        from nanogpt import GPT, GPTConfig, example_batch

        def build_model():
            return GPT(GPTConfig(n_head=3, n_embd=48))
    """))
    result = runner.invoke(app, ["plan", str(model), "--tp", "2"], env=WIDE)
    assert result.exit_code == 2, result.output
    assert "transformer.h.0.attn.c_attn" in result.output and "not divisible" in result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("args,message", [
    (["--tp", "2", "--seq", "100"], "sequence size 100"),  # nanoGPT asserts t <= block_size (64)
    (["--tp", "2", "--gpus-per-node", "3"], "gpus per node"),
    (["--tp", "2", "--world-size", "3"], "does not divide world size"),
])
def test_bad_sizes_exit_2(args, message) -> None:
    result = runner.invoke(app, ["plan", NANOGPT, *args], env=WIDE)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_missing_example_batch_uses_default(tmp_path, planned) -> None:
    model = tmp_path / "no_batch.py"
    model.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(ROOT, "examples")!r})
        from nanogpt import GPT, GPTConfig

        def build_model():
            return GPT(GPTConfig())
    """))
    # autotp.parallelize's default batch, (2, 8) token ids, as earlier versions planned such files
    result = runner.invoke(app, ["plan", str(model), "--tp", "2", "--json", str(tmp_path / "p.json")], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "defines no example_batch(): planned on the default batch, (2, 8) token ids" in result.stdout
    report = json.loads((tmp_path / "p.json").read_text())["report"]
    assert (report["batch"], report["seq"]) == (2, 8)
    assert json.loads((tmp_path / "p.json").read_text())["plan"]["pairs"]
    result = runner.invoke(app, ["plan", str(model), "--tp", "2", "--batch", "2", "--seq", "16", "--dp", "2",
                                 "--gpus-per-node", "2"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "2 node(s) of 2" in result.stdout
    assert "(2, 16) token ids (sizes from --batch/--seq)" in result.stdout
    assert "default batch" not in planned[1].stdout  # nanogpt.py has example_batch()


def test_plan_sequence_parallel(tmp_path) -> None:
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "2", "--sequence-parallel", "--json", str(tmp_path / "sp.json")],
                           env=WIDE)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "sp.json").read_text())
    assert data["plan"]["sequence"]["leaves"] and not data["plan"]["sequence"]["gathers"]
    comm = {(c["direction"], c["kind"], c["op"]): c for c in data["report"]["comm"]}
    b, s, h, L = 4, 32, 64, 2
    # Megatron-SP: the all-reduces of b·s·h become reduce-scatters and all-gathers of the same tensor
    assert comm[("forward", "reduce_scatter", "sum")]["elements"] == (2 * L + 1) * b * s * h
    assert comm[("forward", "all_gather", "")]["elements"] == (2 * L + 1) * b * s * h
    assert comm[("backward", "reduce_scatter", "sum")]["count"] == 2 * L + 1
    # mirror + inputs gathered again for the weight gradients + the learned positions' gradient (s·h)
    assert comm[("backward", "all_gather", "")]["elements"] == 2 * (2 * L + 1) * b * s * h + s * h
    assert ("forward", "all_reduce", "sum") in comm and comm[("forward", "all_reduce", "sum")]["elements"] == 2 * b * s
    assert comm[("backward", "all_reduce", "sum")]["count"] == 1  # norm weights and row biases, summed at once
    text = result.stdout
    assert "tp 2, sequence parallel" in text and "reduce-scatter(sum) b×s×64 = 8,192" in _row(
        text, "transformer.h.0.attn.c_proj")
    assert "Korthikanti" in text


def test_plan_autocast_counts_bytes_as_they_travel(tmp_path, planned) -> None:
    """``--autocast bf16``: the pairs' all-reduces in bf16, the embedding's and the loss's in fp32; the same
    element counts as without it (the module's plan of nanoGPT at tp 2)."""
    assert planned[1].exit_code == 0, planned[1].output
    out = {False: json.loads((planned[0] / "out.json").read_text())["report"]}
    path = tmp_path / "bf16.json"
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "2", "--json", str(path), "--autocast", "bf16"], env=WIDE)
    assert result.exit_code == 0, result.output
    out[True] = json.loads(path.read_text())["report"]
    total = {k: r["comm"][-1] for k, r in out.items()}
    assert total[False]["elements"] == total[True]["elements"] == 82_304
    bsh, bs = 4 * 32 * 64, 4 * 32
    assert total[False]["bytes"] == 4 * total[False]["elements"]
    assert total[True]["bytes"] == 2 * 9 * bsh + 4 * (bsh + 3 * bs)  # 2L + 2L + 1 pair/head ones in bf16
    bad = runner.invoke(app, ["plan", NANOGPT, "--tp", "2", "--autocast", "fp8"], env=WIDE)
    assert bad.exit_code == 2 and "--autocast" in bad.output


# -- --fsdp: FSDP2 over the data-parallel ranks ----------------------------------------------------------------
@pytest.fixture(scope="module")
def fsdp_planned(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "fsdp.json"
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "2", "--dp", "2", "--fsdp", "--json", str(out)], env=WIDE)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.stdout


def test_plan_fsdp_units_cover_the_model_once(fsdp_planned) -> None:
    from nanogpt import GPT, GPTConfig

    data, text = fsdp_planned
    fsdp = data["fsdp"]
    # in the order they run: the positions (only the code before the first block reads them), the blocks, the
    # final norm (only after the last), then the root: the token embedding, tied to the LM head, read at both ends
    assert [(u["kind"], u["module"]) for u in fsdp["units"]] == [
        ("first", "transformer.wpe"), ("block", "transformer.h.0"), ("block", "transformer.h.1"),
        ("last", "transformer.ln_f"), ("root", "<root>")]
    assert [u["modules"] for u in fsdp["units"]] == [
        ["transformer.wpe"], ["transformer.h.0"], ["transformer.h.1"], ["transformer.ln_f"], []]
    assert [(u["kind"], u["module"]) for u in data["plan"]["units"]] == [
        (u["kind"], u["module"]) for u in fsdp["units"][:-1]]
    with torch.device("meta"):
        model = GPT(GPTConfig())
    unique = {id(p): p for p in model.parameters()}.values()  # wte and lm_head are one tensor
    total = sum(p.numel() for p in unique)
    assert sum(u["params"] for u in fsdp["units"]) == total == data["report"]["memory"]["params"]
    assert sum(u["tensors"] for u in fsdp["units"]) == len(list(unique))
    # each unit's elements per tp rank add up to the rank's, and one all-gather over dp 2 restores them (fp32)
    assert sum(u["local"] for u in fsdp["units"]) == data["report"]["memory"]["local"] == fsdp["local"]
    for u in fsdp["units"]:
        assert u["gathered_bytes"] == 4 * u["local"] and u["sharded_bytes"] == u["gathered_bytes"] // 2
    first, *_, last, root = fsdp["units"]
    assert (first["tensors"], first["params"]) == (1, 64 * 64)  # wpe: block_size × n_embd
    assert (last["tensors"], last["params"]) == (2, 2 * 64)  # ln_f: weight and bias
    assert (root["tensors"], root["params"]) == (1, 256 * 64)  # wte, counted once with lm_head
    assert root["local"] == 256 * 64 // 2  # vocab-parallel over tp 2
    assert "what no unit owns" in text and "fsdp units" in text and "fwd, kept" in text


def test_plan_fsdp_memory(fsdp_planned) -> None:
    data, text = fsdp_planned
    fsdp, memory = data["fsdp"], data["report"]["memory"]
    local = memory["local"]  # elements one tp rank holds, the replicated ones whole
    assert fsdp["state_bytes"] == 16 * local / 2
    assert fsdp["ddp_bytes"] == memory["train_bytes_per_rank"] == 16 * local
    units = {u["module"]: u["gathered_bytes"] for u in fsdp["units"]}
    # the root and the last unit stay gathered from their forward into their backward
    assert fsdp["kept_bytes"] == units["<root>"] + units["transformer.ln_f"]
    # the resharded units (wpe, then the blocks) in run order: the largest neighbouring pair is the two blocks
    assert fsdp["prefetch_bytes"] == units["transformer.h.0"] + units["transformer.h.1"] == 2 * 4 * 25_184
    assert fsdp["peak_bytes"] == fsdp["state_bytes"] + fsdp["kept_bytes"] + fsdp["prefetch_bytes"]
    assert fsdp["peak_bytes"] < fsdp["ddp_bytes"]
    assert "root and last unit gathered, kept until their backward" in text
    assert "activations (not estimated here)" in text and "ddp per rank 16·P/t" in text
    # FSDP's reduce-scatter replaces the gradient all-reduce of plain data parallelism
    assert "dp gradient all-reduce" not in text


def test_plan_fsdp_traffic(fsdp_planned) -> None:
    data, text = fsdp_planned
    fsdp = data["fsdp"]
    units = {u["module"]: u["gathered_bytes"] for u in fsdp["units"]}
    traffic = {(x["direction"], x["kind"]): x for x in fsdp["traffic"]}
    assert set(traffic) == {("forward", "all_gather"), ("backward", "all_gather"), ("backward", "reduce_scatter")}
    assert traffic[("forward", "all_gather")]["count"] == 5  # every unit and the root
    assert traffic[("backward", "all_gather")]["count"] == 3  # wpe and the two blocks: resharded after forward
    assert traffic[("backward", "reduce_scatter")]["count"] == 5
    every = 4 * fsdp["local"]  # fp32: every unit's tp shards, gathered whole
    assert traffic[("forward", "all_gather")]["bytes"] == traffic[("backward", "reduce_scatter")]["bytes"] == every
    assert traffic[("backward", "all_gather")]["bytes"] == every - fsdp["kept_bytes"] == (
        units["transformer.wpe"] + units["transformer.h.0"] + units["transformer.h.1"])
    for x in traffic.values():  # a ring over d = 2 ranks sends half of it
        assert x["sent"] == x["bytes"] // 2
    assert "reduce-scatter(sum)" in text and "fsdp communication per training step" in text
    assert "first + 2 blocks + last + root" in text


def test_plan_without_fsdp_has_no_fsdp_key(planned) -> None:
    out, result = planned
    assert "fsdp" not in json.loads((out / "out.json").read_text())
    assert "fsdp units" not in result.stdout


@pytest.mark.parametrize("args", [["--tp", "2", "--fsdp"], ["--tp", "2", "--dp", "1", "--fsdp"],
                                  ["--tp", "2", "--world-size", "2", "--fsdp"]])
def test_plan_fsdp_needs_dp(args) -> None:
    result = runner.invoke(app, ["plan", NANOGPT, *args], env=WIDE)
    assert result.exit_code == 2, result.output
    assert "--fsdp" in result.output and "--dp 2 or more" in result.output and "Traceback" not in result.output


def test_plan_fsdp_with_sequence_parallelism() -> None:
    """FSDP × sequence parallelism plans (parallelize runs it: tests/runtime/test_fsdp.py)."""
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "2", "--dp", "2", "--fsdp", "--sequence-parallel"],
                           env=WIDE)
    assert result.exit_code == 0, result.output
    assert "fsdp units" in result.stdout and "sequence parallelism" in result.stdout


def test_fsdp_report_pads_uneven_rows() -> None:
    """FSDP2 cuts dim 0 of a tp shard into d chunks of ceil(n/d) rows: a 3-row tensor over dp 2 keeps 2 rows."""
    from autotp.plan.plan import Plan, Unit
    from autotp.reports.sharding import fsdp_report

    embed, block, head = torch.nn.Embedding(7, 4), torch.nn.Linear(4, 3), torch.nn.Linear(3, 5, bias=False)
    norm = torch.nn.LayerNorm(3)
    named = [("embed.weight", embed.weight), ("block.weight", block.weight), ("block.bias", block.bias),
             ("norm.weight", norm.weight), ("norm.bias", norm.bias), ("head.weight", head.weight)]
    units = (Unit("embed", ("embed.weight",), "first", ("embed",)), Unit("block", ("block.weight", "block.bias")),
             Unit("norm", ("norm.weight", "norm.bias"), "last", ("norm",)))
    fsdp = fsdp_report(Plan(tp=1, units=units), named, 2)
    assert [(u.kind, u.module) for u in fsdp.units] == [
        ("first", "embed"), ("block", "block"), ("last", "norm"), ("root", "<root>")]
    e, b, n, root = fsdp.units
    assert (e.params, e.gathered_bytes, e.sharded_bytes) == (28, 112, 4 * 4 * 4)  # 7 rows: 4 kept
    assert (b.params, b.gathered_bytes, b.sharded_bytes) == (15, 60, 4 * (2 * 4 + 2))
    assert (n.params, n.gathered_bytes, n.sharded_bytes) == (6, 24, 4 * (2 + 2))
    assert (root.params, root.sharded_bytes) == (15, 4 * 3 * 3)
    assert fsdp.prefetch_bytes == 112 + 60  # the embedding and the one block, both resharded
    assert fsdp.kept_bytes == 24 + 60  # the last unit and the root
    assert [(x.direction, x.kind, x.count) for x in fsdp.traffic] == [
        ("forward", "all_gather", 4), ("backward", "all_gather", 2), ("backward", "reduce_scatter", 4)]
    # one block alone, nothing else: nothing to prefetch, and no root without tensors
    alone = fsdp_report(Plan(tp=1, units=(Unit("block", ("block.weight", "block.bias")),)), named[1:3], 2)
    assert [u.kind for u in alone.units] == ["block"]
    assert (alone.prefetch_bytes, alone.kept_bytes) == (60, 0)


def test_fsdp_report_over_the_context_ranks() -> None:
    """With cp FSDP shards over the dp × cp ranks (the runtime's dp_cp mesh): at dp 1 × cp 2 every figure is the
    one over 2 data-parallel ranks, and the tables say which ranks."""
    import io

    from rich.console import Console

    from autotp.cli.plan_tables import fsdp_memory_table, fsdp_traffic_table, fsdp_units_table
    from autotp.plan.plan import Plan, Unit
    from autotp.reports.sharding import fsdp_from_rows, param_rows

    block = torch.nn.Linear(4, 3)
    plan = Plan(tp=1, units=(Unit("block", ("block.weight", "block.bias")),))
    rows = param_rows(plan, [("block.weight", block.weight), ("block.bias", block.bias)])
    over_cp, over_dp = fsdp_from_rows(plan, rows, 1, cp=2), fsdp_from_rows(plan, rows, 2)
    assert (over_cp.dp, over_cp.cp, over_cp.ranks, over_dp.ranks) == (1, 2, 2, 2)

    def figures(r):
        return r.units, r.state_bytes, r.kept_bytes, r.prefetch_bytes, r.traffic

    assert figures(over_cp) == figures(over_dp) and over_cp.state_bytes == 16 * 15 // 2
    assert over_cp.traffic[0].sent == 60 // 2  # a ring all-gather sends (d−1)/d of the 60 bytes, d = 2
    out = io.StringIO()
    console = Console(file=out, width=300)
    for table in (fsdp_units_table, fsdp_memory_table, fsdp_traffic_table):
        console.print(table(over_cp))
    text = " ".join(out.getvalue().split())
    assert text.count("dp 1 × cp 2 = 2 ranks") == 3 and "(d−1)/d = 0.50×" in text, text


def test_fsdp_report_in_the_gather_dtype() -> None:
    """--fsdp-param-dtype bf16: the gathers and the units held gathered in bf16, the reduce-scatters in fp32
    (FSDP2's MixedPrecisionPolicy as autotp shard sets it); the sharded state stays in the model's dtype."""
    from rich.console import Console

    from autotp.cli.plan_tables import fsdp_traffic_table
    from autotp.plan.plan import Plan, Unit
    from autotp.reports.sharding import fsdp_report

    block, norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    named = [("block.weight", block.weight), ("block.bias", block.bias), ("norm.weight", norm.weight),
             ("norm.bias", norm.bias)]
    plan = Plan(tp=1, units=(Unit("block", ("block.weight", "block.bias")),
                             Unit("norm", ("norm.weight", "norm.bias"), "last", ("norm",))))
    plain, mixed = fsdp_report(plan, named, 2), fsdp_report(plan, named, 2, "bfloat16", "float32")
    assert [u.gathered_bytes for u in plain.units] == [80, 32] and [u.gathered_bytes for u in mixed.units] == [40, 16]
    assert [u.sharded_bytes for u in mixed.units] == [u.sharded_bytes for u in plain.units]
    assert mixed.state_bytes == plain.state_bytes and mixed.kept_bytes == 16 and mixed.prefetch_bytes == 40
    bytes_of = {(x.direction, x.kind): (x.bytes, x.sent) for x in mixed.traffic}
    assert bytes_of == {("forward", "all_gather"): (56, 28), ("backward", "all_gather"): (40, 20),
                        ("backward", "reduce_scatter"): (112, 56)}
    console = Console(width=200, record=True)
    console.print(fsdp_traffic_table(mixed))
    assert "gathered in bfloat16, reduced in float32" in console.export_text()


# -- --pp: pipeline stages, what crosses each cut, the bubble ---------------------------------------------------
def _model_file(tmp_path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{os.path.join(ROOT, "examples")!r}, {os.path.join(ROOT, "tests", "support")!r}]
        import torch
    """) + textwrap.dedent(body))
    return str(path)


@pytest.fixture(scope="module")
def gpt4(tmp_path_factory) -> str:
    """examples/nanogpt.py with 4 blocks, a batch of 8 × 16 (tests/support/pipeline_models.py's)."""
    return _model_file(tmp_path_factory.mktemp("gpt4"), "gpt4", """
        from nanogpt import GPT, GPTConfig

        def build_model():
            return GPT(GPTConfig(n_layer=4))

        def example_batch():
            g = torch.Generator().manual_seed(1)
            return torch.randint(0, 256, (8, 16), generator=g), torch.randint(0, 256, (8, 16), generator=g)
    """)


def _pipeline(tmp_path, model: str, *args: str) -> tuple[dict, str]:
    out = tmp_path / "pp.json"
    result = runner.invoke(app, ["plan", model, "--tp", "2", *args, "--json", str(out)], env=WIDE)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.stdout


@pytest.fixture(scope="module")
def gpt4_pp2(tmp_path_factory, gpt4) -> tuple[dict, str]:
    return _pipeline(tmp_path_factory.mktemp("pp2"), gpt4, "--pp", "2")


def test_plan_pp_stages_table(gpt4_pp2) -> None:
    data, text = gpt4_pp2
    pipe, memory = data["pipeline"], data["report"]["memory"]
    assert (pipe["pp"], pipe["virtual_stages"], pipe["microbatches"], pipe["schedule"]) == (2, 1, 2, "1F1B")
    stages = pipe["stages"]
    # the blocks split in two contiguous halves (balanced by FLOPs: the LM head weighs on the last stage)
    assert [s["blocks"] for s in stages] == [["transformer.h.0", "transformer.h.1"],
                                             ["transformer.h.2", "transformer.h.3"]]
    assert [s["blocks"] for s in stages] == [s["blocks"] for s in data["plan"]["stages"]]
    assert [(s["rank"], s["first"], s["last"]) for s in stages] == [(0, True, False), (1, False, True)]
    # per tp rank, the stages cover the model: the tied wte / lm_head is held by both ends, so once too many
    assert len(pipe["shared"]) == 1 and pipe["shared"][0] in ("transformer.wte.weight", "lm_head.weight")
    tied = 256 * 64 // 2  # vocab-parallel over tp 2
    assert sum(s["params"] for s in stages) == memory["local"] + tied
    assert sum(s["param_bytes"] for s in stages) == memory["bytes_per_rank"] + 4 * tied
    assert [s["param_bytes"] for s in stages] == [s["param_bytes"] for s in data["plan"]["stages"]]
    # one rank's params per stage here, the tied tensor once
    assert [r["params"] for r in pipe["ranks"]] == [s["params"] for s in stages]
    # Korthikanti et al. per block at b = 8/2, s 16, h 64, a 4, t 2, fp32 without dropout, s×s scores kept:
    # s·b·h·(16 + 48/t) + 4·a·s²·b/t
    b, s, h, a, t = 4, 16, 64, 4, 2
    block = s * b * h * 16 + (s * b * h * 48 + 4 * a * s * s * b) // t
    assert pipe["activations"]["layer_bytes"] == block == 172_032
    assert [x["activation_bytes"] for x in stages] == [2 * block, 2 * block]
    # 1F1B keeps min(m, p − r) micro-batches on rank r
    assert [(r["in_flight"], r["activation_bytes"]) for r in pipe["ranks"]] == [(2, 4 * block), (1, 2 * block)]
    # forward FLOPs per micro-batch: the last stage's LM head (2·b·s·h·V) on top of equal blocks
    assert stages[1]["flops"] - stages[0]["flops"] == 2 * b * s * h * 256
    assert "pipeline stages: pp 2 × v 1, 1F1B, 2 micro-batches of b=4, s=16, tp 2" in text
    assert "embeddings" in _row(text, "transformer.h.0 … transformer.h.1 (2)")
    assert "final norm, LM head, loss" in _row(text, "transformer.h.2 … transformer.h.3 (2)")
    assert "1F1B keeps min(m, p − r) on pipeline rank r" in text


def test_plan_pp_p2p_nanogpt_hidden_state_only(gpt4_pp2) -> None:
    data, text = gpt4_pp2
    pipe = data["pipeline"]
    (cut,) = pipe["cuts"]
    assert (cut["after"], cut["src"], cut["dst"], cut["sent"]) == (0, 0, 1, True)
    # the hidden state (b/m, s, h) alone: token ids and targets are inputs of every stage, wte a parameter
    (value,) = cut["values"]
    assert value["shape"] == [4, 16, 64] and value["dtype"] == "float32" and value["grad"]
    assert value["module"] == "transformer.h.1"
    assert value["bytes"] == cut["forward_bytes"] == cut["backward_bytes"] == 4 * 16 * 64 * 4
    assert pipe["step_bytes"] == 2 * (2 * 4 * 16 * 64 * 4)  # m micro-batches, forward and backward
    assert "[4, 16, 64]" in text and "per step (× m = 2)" in text


def test_plan_pp_p2p_llama_sends_the_hidden_state_only(tmp_path) -> None:
    model = _model_file(tmp_path, "llama4", """
        from transformers import LlamaConfig, LlamaForCausalLM

        def build_model():
            cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              bos_token_id=0, eos_token_id=0, pad_token_id=0, loss_type="ForCausalLM",
                              tie_word_embeddings=False)
            return LlamaForCausalLM(cfg)

        def example_batch():
            ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
            return (), {"input_ids": ids, "labels": ids, "use_cache": False}
    """)
    data, text = _pipeline(tmp_path, model, "--pp", "2")
    pipe = data["pipeline"]
    (cut,) = pipe["cuts"]
    # the causal mask and rotary cos/sin are made from the inputs and a buffer alone: each stage makes its own
    assert [(v["shape"], v["dtype"], v["grad"], v["module"]) for v in cut["values"]] == [
        ([4, 16, 64], "float32", True, "model.layers.1")]
    assert cut["backward_bytes"] == cut["forward_bytes"] == 4 * 16 * 64 * 4
    assert pipe["shared"] == []  # untied: no parameter in two stages
    assert pipe["activations"]["fused"]  # SDPA: no s×s scores


def test_plan_pp_bubble_gpipe(tmp_path, gpt4) -> None:
    data, text = _pipeline(tmp_path, gpt4, "--pp", "2", "--schedule", "gpipe", "--microbatches", "4")
    pipe = data["pipeline"]
    assert pipe["schedule"] == "GPipe" and pipe["micro_batch"] == 2
    assert pipe["bubble"] == {"formula": "(p − 1)/m", "fraction": 0.25, "upper_bound": False}
    assert [r["in_flight"] for r in pipe["ranks"]] == [4, 4]  # every micro-batch forward before any backward
    assert "(p − 1)/m = (2 − 1)/4 of the ideal step time (a step ≈ 1.25× the ideal)" in text


def test_plan_pp_bubble_interleaved(tmp_path, gpt4) -> None:
    data, text = _pipeline(tmp_path, gpt4, "--pp", "2", "--schedule", "Interleaved1F1B", "--microbatches", "4")
    pipe = data["pipeline"]
    assert pipe["virtual_stages"] == 2  # the interleaved schedules' default
    assert pipe["bubble"] == {"formula": "(p − 1)/(v·m)", "fraction": 1 / 8, "upper_bound": False}
    assert "(p − 1)/(v·m) = (2 − 1)/(2·4) of the ideal step time" in text
    # stage s on rank s mod p, one block each; every one of the p·v − 1 cuts crosses ranks (3 → 0 wraps round)
    assert [(s["rank"], len(s["blocks"])) for s in pipe["stages"]] == [(0, 1), (1, 1), (0, 1), (1, 1)]
    assert [(c["src"], c["dst"]) for c in pipe["cuts"]] == [(0, 1), (1, 0), (0, 1)]
    hidden = 2 * 16 * 64 * 4  # b/m = 2
    assert pipe["step_bytes"] == 4 * 3 * 2 * hidden
    # the tied embedding / LM head: stages 0 and 3, on ranks 0 and 1
    assert [r["stages"] for r in pipe["ranks"]] == [[0, 2], [1, 3]]
    assert "pipeline ranks: 2 stages each" in text
    # torch's warm-up: (v − 1)·m_round + 2·(p − 1 − r) forwards, one more before the first backward
    assert [r["in_flight"] for r in pipe["ranks"]] == [min(8, 1 * 2 + 2 + 1), min(8, 1 * 2 + 0 + 1)]


def test_pipeline_schedule_numbers() -> None:
    from autotp.reports.pipeline import bubble, in_flight, layer_activation_bytes

    p, v = 4, 2
    assert [in_flight("1F1B", p, 1, 8, r) for r in range(p)] == [4, 3, 2, 1]
    assert [in_flight("1F1B", p, 1, 2, r) for r in range(p)] == [2, 2, 2, 1]
    assert in_flight("GPipe", p, 1, 8, 3) == 8 and in_flight("LoopedBFS", p, v, 8, 0) == v * 8
    # Korthikanti et al. §4.2.3: rank 0 of the interleaved schedule holds v·p + p − 1 stage-micro-batches of
    # L/(v·p) layers, L·(1 + (p − 1)/(v·p)) layers' worth; never more than all v·m of them
    assert in_flight("Interleaved1F1B", p, v, 2 * p, 0) == v * p + p - 1
    assert in_flight("Interleaved1F1B", p, v, p, 0) == v * p
    assert in_flight("Interleaved1F1B", p, v, 2 * p, p - 1) == v * p - p + 1
    assert in_flight("ZBVZeroBubble", p, 2, 8, 3) == 2 * p
    assert bubble("1F1B", p, 1, 8).fraction == 3 / 8 and bubble("Interleaved1F1B", p, v, 8).fraction == 3 / 16
    assert bubble("ZBVZeroBubble", p, 2, 8).upper_bound and not bubble("GPipe", p, 1, 8).upper_bound
    # DESIGN §4 at 16-bit with dropout: s·b·h·(10 + 24/t + 5·a·s/(h·t))
    s, b, h, a, t = 128, 2, 256, 8, 4
    assert layer_activation_bytes(b, s, h, a, t) == s * b * h * 10 + (s * b * h * 24 + 5 * a * s * s * b) // t
    assert layer_activation_bytes(b, s, h, a, t, fused=True) == s * b * h * (10 + 24 // t)
    # §4.2.2, sequence parallelism: every term split over t, s·b·h·34/t with fused attention
    assert layer_activation_bytes(b, s, h, a, t, fused=True, sequence_parallel=True) == s * b * h * 34 // t


def test_plan_without_pp_has_no_pipeline(planned) -> None:
    out, result = planned
    assert "pipeline" not in json.loads((out / "out.json").read_text())
    assert "pipeline stages" not in result.stdout and "bubble" not in result.stdout


def test_plan_pp_with_fsdp_says_each_stage_is_one_unit() -> None:
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "1", "--dp", "2", "--pp", "2", "--fsdp"], env=WIDE)
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "each of a rank's stages is one FSDP2 unit over dp 2" in out and "fsdp units:" not in out


def test_plan_pp_at_a_batch_larger_than_a_one_row_example(tmp_path) -> None:
    """A model file whose example batch has one row (export would fix the batch dim at 1) planned at --batch 8
    in 8 micro-batches: every number is for b = 8 (micro-batches of 1), none for b = 1 or b/m = 0; each
    pipeline rank's memory (training state + activations) is checked against --gpu's."""
    model = _model_file(tmp_path, "one_row", """
        from nanogpt import GPT, GPTConfig

        def build_model():
            return GPT(GPTConfig(n_layer=4))

        def example_batch():
            ids = torch.zeros(1, 16, dtype=torch.long)
            return ids, ids
    """)
    data, text = _pipeline(tmp_path, model, "--pp", "2", "--microbatches", "8", "--batch", "8", "--gpu", "h100")
    out = " ".join(text.split())
    assert data["report"]["batch"] == 8 and data["pipeline"]["micro_batch"] == 1, data["pipeline"]["micro_batch"]
    assert "fixed at 1" not in out and "b=0" not in out and "b=8, s=16" in out
    for r in data["pipeline"]["ranks"]:
        assert r["state_bytes"] == 16 * r["params"]
    peak = max(r["state_bytes"] + r["activation_bytes"] for r in data["pipeline"]["ranks"])
    assert "memory per rank: at most" in out and "usable on h100" in out and ": fits" in out
    assert peak > 0


def test_plan_pp_with_sequence_parallelism_sends_s_over_t() -> None:
    """Each stage sums its own sequence-parallel gradients; the hidden state crossing the cut is s/t per rank
    (b=4 in 2 micro-batches, s=32 at tp 2: [2, 16, 64])."""
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "2", "--pp", "2", "--sequence-parallel", "--no-cache"],
                           env=WIDE)
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "[2, 16, 64]" in out and "(per stage)" in out


@pytest.mark.parametrize("args,message", [
    (["--pp", "2", "--schedule", "Foo"], "unknown pipeline schedule 'Foo'"),
    (["--pp", "2", "--virtual-stages", "2"], "schedule 1F1B runs one stage per rank, and --virtual-stages is 2"),
    (["--pp", "2", "--schedule", "ZBVZeroBubble", "--virtual-stages", "3"], "exactly 2 stages per rank"),
    (["--pp", "2", "--microbatches", "1"], "needs at least as many micro-batches as pipeline ranks"),
    (["--pp", "2", "--microbatches", "3"], "3 micro-batches do not divide the batch of 4"),  # example: 4 × 32
    (["--pp", "2", "--split-points", "transformer.h.1,"], "names an empty block"),
    (["--schedule", "GPipe"], "--schedule applies to pipeline stages, and --pp is 1; give --pp 2 or more"),
    (["--pp", "2", "--dp", "2", "--fsdp", "--schedule", "ZBVZeroBubble"],
     "fsdp with the ZBVZeroBubble schedule is not supported yet"),
])
def test_plan_pp_bad_options_exit_2_before_capture(monkeypatch, args, message) -> None:
    def no_capture(*a, **k):
        raise AssertionError("captured before the options were checked")

    monkeypatch.setattr("autotp.parallel.planning.capture", no_capture)
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "2", *args], env=WIDE)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("args,message", [
    # examples/nanogpt.py has 2 blocks; Interleaved1F1B's default is 2 stages per rank
    (["--pp", "2", "--schedule", "Interleaved1F1B"], "4 pipeline stages (pp × virtual stages) need a block each, "
                                                     "and the graph has 2 repeated blocks"),
    (["--pp", "2", "--split-points", "transformer.h.9"], "split point 'transformer.h.9' is not one of the model's blocks"),
    (["--pp", "2", "--split-points", "transformer.h.0"], "does not come after the previous stage's first block"),
    (["--pp", "2", "--split-points", "transformer.h.1,transformer.h.1"], "--split-points names 2 blocks, but 2 "
                                                                          "stages start at 1"),
])
def test_plan_pp_bad_stages_exit_2(args, message) -> None:
    result = runner.invoke(app, ["plan", NANOGPT, "--tp", "2", *args], env=WIDE)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_plan_pp_split_points(tmp_path, gpt4) -> None:
    data, text = _pipeline(tmp_path, gpt4, "--pp", "2", "--split-points", "transformer.h.1")
    assert [s["blocks"] for s in data["pipeline"]["stages"]] == [
        ["transformer.h.0"], ["transformer.h.1", "transformer.h.2", "transformer.h.3"]]
    assert data["pipeline"]["cuts"][0]["values"][0]["module"] == "transformer.h.0"


@pytest.mark.parametrize("name,loss", [("nanogpt", 1), ("llama", 0)])  # the loss's place in the flat outputs
def test_crossing_is_what_the_pipeline_sends(name, loss) -> None:
    """The values the report finds at each cut are those autotp.pipeline's stages send (captured static)."""
    from pipeline_models import MODELS

    from autotp.passes.split_stages import split_stages
    from autotp.reports.pipeline import crossing, node_stages
    from autotp.plan.stages import StageRequest
    from autotp.operators.stages import wire_stages

    model, args, kwargs = MODELS[name]()
    gm, _ = capture(model, args, kwargs, static=True)
    plan = make_plan(gm, 1, stages=StageRequest(4))
    cuts = crossing(gm, node_stages(gm, plan), 4)
    sent = [w.send for w in wire_stages(split_stages(gm, plan), loss)[:-1]]
    assert [len(c) for c in cuts] == [len(s) for s in sent] == [1] * 3  # masks, rotary tables: made again
    assert all(c[-1].shape == (8, 16, 64) and c[-1].grad for c in cuts)  # the hidden state, last computed


def test_layer_table_shows_a_run_of_identical_layers_once(tmp_path) -> None:
    """Layers 0–2 and 4–6 have the same rows; layer 3's MLP is wider, so it stands alone and splits the run."""
    from rich.console import Console

    from autotp.cli.tp_tables import layer_table
    from autotp.parallel.planning import plan_file

    model = _model_file(tmp_path, "seven", """
        import torch.nn as nn
        from nanogpt import GPT, GPTConfig

        def build_model():
            m = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=7, n_head=2, n_embd=32))
            m.transformer.h[3].mlp.c_fc, m.transformer.h[3].mlp.c_proj = nn.Linear(32, 256), nn.Linear(256, 32)
            return m

        def example_batch():
            return torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)
    """)
    planned = plan_file(model, 2, cache=False)
    console = Console(width=240, record=True)
    console.print(layer_table(planned.report, planned.names))
    text = console.export_text()
    assert "transformer.h.0–2.mlp.c_fc " in text and "transformer.h.4–6.attn.c_proj " in text
    assert "transformer.h.3.mlp.c_fc " in text and "[256, 32]" in text  # the wider layer, alone
    assert "transformer.h.1." not in text and "transformer.h.5." not in text
    assert "layers a–b: each of layers a to b has these rows" in text
    # two identical layers are not a run: gpt4's fixture with 2 blocks shows each
    two = plan_file(NANOGPT, 2, cache=False)
    console = Console(width=240, record=True)
    console.print(layer_table(two.report, two.names))
    text = console.export_text()
    assert "transformer.h.0.attn.c_attn " in text and "transformer.h.1.attn.c_attn " in text and "–" not in text
