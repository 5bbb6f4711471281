"""Which ops real models put in autotp's graphs, and which sharding rule each one gets.

    python benchmarks/op_coverage.py               # writes benchmarks/results/op_coverage.{json,md}
    python benchmarks/op_coverage.py --all         # every Hugging Face causal-LM family, not the default subset
    python benchmarks/op_coverage.py --families llama,gpt2   # just these families (and the test models)
    python benchmarks/op_coverage.py --all --jobs 3  # three models captured at once (each alone in its process)
    python benchmarks/op_coverage.py --all --plans-only   # only the families' plans (op_coverage_plans.{json,md})
    python benchmarks/op_coverage.py --plans-only --update --families bert,roberta   # these again, the rest kept

Models:

- every test model: each ``KINDS`` entry of the modules ``tests/*_models.py`` that define ``KINDS`` and
  ``build(kind) -> (model, args, kwargs)``, captured in train and eval mode, in fp32 and under
  ``torch.autocast("cpu", dtype=torch.bfloat16)`` (4 captures each);
- Hugging Face causal-LM families of the installed transformers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``),
  each from its config class with tiny sizes wherever the config has the attribute (width 64, 2 layers,
  4 heads, 2 kv heads (4 where 2 does not build, and for latent attention), head dim 16, intermediate 128,
  vocab 128, 64 positions, 4 experts of 32 features with top-2 routing in 1 group, a Mamba-2 mixer's 8 heads of
  16 in 4 groups of 16 states, a partial rotary part of 8, special token ids 0; sub-configs
  such as ``text_config`` get the same sizes; a per-layer list keeps 2 entries, its first and the first of
  another kind, so a hybrid keeps both kinds of layer), ``torch.manual_seed(0)``,
  ``AutoModelForCausalLM.from_config``, called on ``input_ids`` of shape (2, 8) with ``labels=input_ids`` so
  the loss is in the graph, and ``config.use_cache = False`` (a training step's call: no KV cache); what a
  family's call cannot do without besides (X-MOD's default language, GIT's image) is given too.
  Two captures per family, train/fp32 and eval/bf16-autocast: four would double a run that these
  captures dominate. By default a deterministic subset (every fifth family in the mapping's order, plus
  the families the tests build); ``--all`` runs all of them.

Every model runs in a worker process; a build or capture that takes more than ``--timeout`` seconds (60)
is stopped and the family (or test model) recorded with the stage it was at.

Each distinct op (``call_function`` nodes whose target is an ``OpOverload``, nested graph modules
included: aten's, and custom ops a model library registers, such as ``transformers.grouped_mm_fallback``)
is classed "autotp" (autotp's own table, or its rule for ops tagged pointwise), "dtensor strategy" /
"dtensor decomposition" (no table entry; DTensor's sharding propagator registers a strategy for it, or
derives one from torch's decomposition: :func:`autotp.analysis.torch_rules.torch_rule_source`), or
"nothing". "before" is the same question put to the code without torch's rules: a ``git worktree`` of the
commit before ``autotp/analysis/torch_rules.py`` was added (HEAD while it is not committed), imported in a
subprocess; it has autotp's table only. Ops whose parameter operand autotp reads as a weight outside the
table (``linear``, ``mm``, ``einsum``, ``embedding``, grouped GEMMs) are listed apart: that part of their
handling is the same before and now.

For each Hugging Face family whose train/fp32 capture succeeds: ``make_plan(gm, tp)`` at tp 2 and 4, now
and with that code. A plan is *fully sharded* when nothing is left replicated (``plan.replicated == ()``)
and every weight left whole (``plan.whole``) is whole by design: a router, gate or latent down-projection
(Megatron keeps them whole), a position embedding, the bias of a row-parallel layer, or a weight the graph
does not read. Any other whole weight (an attention or MLP projection, a token embedding not made
vocab-parallel, a weight read by an op with no rule) is a gap.

Measured: op classes and plans only. Parity of the sharded families against the unsharded model is not
run here (tests/runtime/test_parity.py and benchmarks/parity_report.py measure it for the models they cover).
"""
from __future__ import annotations

import argparse
import glob
import importlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
sys.path[:0] = [os.path.join(ROOT, "tests", "support")]
if os.environ.get("OP_COVERAGE_BEFORE"):
    # the worktree's autotp only: the editable install's finder would fill in modules the worktree lacks
    # (autotp.analysis.torch_rules) from the working tree
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]

BEFORE_TREE = "/tmp/autotp_before"
TEST_MODES = (("train", "fp32"), ("train", "bf16"), ("eval", "fp32"), ("eval", "bf16"))
HF_MODES = (("train", "fp32"), ("eval", "bf16"))
PLAN_MODE = ("train", "fp32")  # a training step's graph (loss included) is what tensor parallelism shards
TPS = (2, 4)
CLASSES = ("autotp", "dtensor strategy", "dtensor decomposition", "nothing")
# ops autotp's analysis reads outside its op table when a parameter is an operand (autotp.analysis.matmuls:
# the weight of a column/row pair or of experts, a grouped GEMM by its name; autotp.analysis.vocab: a token
# embedding): their class below is the op table's, for the other operands
WEIGHT_OPS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default", "aten.matmul.default",
              "aten.einsum.default", "aten.embedding.default")


def read_as_weight(name: str) -> bool:
    return name in WEIGHT_OPS or name.split(".")[1].startswith(("_grouped_mm", "grouped_mm"))


# the Hugging Face families the tests build: always in the default subset
ALWAYS = ("gpt2", "llama", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
# a weight left whole for one of these reasons is whole by design (Megatron keeps it whole too), not a gap
WHOLE_BY_DESIGN = ("router kept whole", "gate kept whole", "down-projection kept whole", "head transform kept whole",
                   "indexer kept whole", "latent kept whole", "scale kept whole",
                   "position embedding", "bias of the row-parallel", "not read by this call's graph",
                   "read by nothing", "head-shared weight kept whole", "filter kept whole", "input kept whole",
                   "post-row linear kept whole", "input stem kept whole")

# tiny sizes, by every attribute name a config may use for them
_TINY = {
    **dict.fromkeys(("hidden_size", "n_embd", "n_embed", "d_model", "embed_dim", "embedding_size",
                     "hidden_size_global"), 64),  # BLT's local encoder and decoder name the global width too
    "encoder_hash_byte_group_vocab": 128,  # BLT's hashed n-gram tables (500002 rows each by default)
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
                     "num_decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads"), 4),
    **dict.fromkeys(("head_dim", "kv_channels"), 16),
    # a partial rotary part's width (CodeGen, GPT-J: 64 of a 256 head dim): half the tiny head dim, so the
    # rotated and passed-through parts both stay (left at 64 it is wider than the head and does not broadcast)
    "rotary_dim": 8,
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "d_ff", "d_inner", "decoder_ffn_dim",
                     "encoder_ffn_dim", "ffn_hidden_size"), 128),
    "vocab_size": 128,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length"), 64),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k"), 2),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size"), 32),
    **dict.fromkeys(("n_group", "num_expert_group", "topk_group", "first_k_dense_replace"), 1),
    "zero_expert_num": 2,  # LongCat-Flash's identity experts, routed beside the 4
    # Kimi Delta Attention (Kimi-Linear, Bailing-Hybrid): 4 heads of 16, as attention's
    "linear_num_heads": 4, "linear_head_dim": 16,
    "attn_layer_period": 2, "attn_layer_offset": 1,  # a hybrid's attention layer within the 2 layers
    # a Mamba-2 mixer: 8 SSM heads of 16 (d_inner 128) in 4 groups of 16 B/C states. Left alone, the defaults
    # give 128 heads of 1 in 1 group (a group's gated norm spans every head: no exact cut at tp > 1, as in
    # Megatron, which asks tp to divide the groups); Nemotron-H's config names differ and keep their 8 groups
    **dict.fromkeys(("mamba_n_heads", "n_mamba_heads"), 8), **dict.fromkeys(("mamba_d_head", "mamba_headdim"), 16),
    **dict.fromkeys(("mamba_n_groups", "mamba_ngroups"), 4), "mamba_d_state": 16, "mamba_d_ssm": 128,
}
# latent attention (DeepSeek): set only where the default is not None (None: no such projection)
_LATENT = {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")


# -- in the worker -------------------------------------------------------------------------------------
def _tiny_kwargs(default, kv: int) -> dict:
    """The tiny sizes for the attributes ``default`` (a config built with its defaults) has."""
    have = default.to_dict()
    out = {k: v for k, v in _TINY.items() if k in have}
    out.update({k: v for k, v in _LATENT.items() if have.get(k) is not None})
    if "qk_rope_head_dim" in have:  # there head_dim is the rotary part's: derived from it, or set to it (LongCat)
        out.pop("head_dim", None)
        if have.get("head_dim") == have["qk_rope_head_dim"] and "qk_rope_head_dim" in out:
            out["head_dim"] = out["qk_rope_head_dim"]
    # latent attention shares one rotary key across heads and has no kv groups: as many kv heads as heads
    out.update({k: 4 if "kv_lora_rank" in have else kv for k in _KV_HEADS if k in have})
    out.update({k: 0 for k in _TOKEN_IDS if have.get(k) is not None})  # ids past the tiny vocab would not embed
    layers = next((have[k] for k in _LAYER_COUNTS if isinstance(have.get(k), int)), None)
    for k, v in have.items():  # one entry per layer (layer types, a hybrid's pattern): 2 of them, different
        if k not in out and layers and layers > 2 and isinstance(v, (list, str)) and len(v) == layers:
            other = next((x for x in v if x != v[0]), v[1])  # a hybrid keeps a layer of each of its first 2 kinds
            out[k] = v[:1] + (other if isinstance(v, str) else [other])
    return out


def hf_config(family: str, kv: int):
    from transformers import CONFIG_MAPPING, PretrainedConfig

    cls = CONFIG_MAPPING[family]
    default = cls()
    kwargs = _tiny_kwargs(default, kv)
    for key in getattr(cls, "sub_configs", {}) or {}:
        sub = getattr(default, key, None)
        if isinstance(sub, PretrainedConfig):
            kwargs[key] = {"model_type": sub.model_type, **_tiny_kwargs(sub, kv)}
    cfg = cls(**kwargs)
    if hasattr(cfg, "loss_type"):
        cfg.loss_type = "ForCausalLM"
    return cfg


def _build_hf(family: str, kv: int | None):
    """(model, args, kwargs, kv heads used); tries 2 kv heads, then 4, unless ``kv`` is given."""
    import torch
    from transformers import AutoModelForCausalLM

    err = None
    for n in (kv,) if kv else (2, 4):
        try:
            cfg = hf_config(family, n)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg)
        except Exception as e:  # noqa: BLE001 - a family that does not build is a result, not a failure
            err = err or e
            continue
        # a training step's call builds no KV cache (and autotp's capture walks a returned cache object by
        # object: for some cache classes that alone takes longer than the time limit)
        model.config.use_cache = False
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
        return model, (), {"input_ids": ids, "labels": ids, **_needed_inputs(model, cfg)}, n
    raise err


def _needed_inputs(model, cfg) -> dict:
    """What a family's training call cannot do without besides the tokens. X-MOD routes every layer through
    one language's adapter: the default language is set to the config's first (the model asks for it).
    GIT captions an image: its loss skips the image's tokens, which come first, so it is given one (2 images
    of the vision config's size)."""
    import torch

    if getattr(cfg, "languages", None) and hasattr(model, "set_default_language"):
        model.set_default_language(cfg.languages[0])
    vision = getattr(cfg, "vision_config", None)
    if getattr(cfg, "model_type", None) == "git" and vision is not None:
        g = torch.Generator().manual_seed(2)
        return {"pixel_values": torch.randn(2, vision.num_channels, vision.image_size, vision.image_size, generator=g)}
    return {}


def _ops_of(gm) -> tuple[list[str], dict[str, str]]:
    """The graph's ops by name, and for ops outside aten the module that defines them (a custom op of
    transformers exists in another process only once that module is imported)."""
    import torch
    import torch.fx as fx
    from torch._library.custom_ops import OPDEFS

    ops = {n.target for g in gm.modules() if isinstance(g, fx.GraphModule) for n in g.graph.nodes
           if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}
    where = {str(op): OPDEFS[op._schema.name]._init_fn.__module__ for op in ops
             if op.namespace != "aten" and op._schema.name in OPDEFS}
    return sorted(map(str, ops)), where


def _plan_summary(gm, tp: int) -> dict:
    from autotp.plan.planner import make_plan

    try:
        plan = make_plan(gm, tp)
    except Exception as e:  # noqa: BLE001
        return {"error": _first_line(e), "fully_sharded": False}
    gaps = [(w.name, w.reason) for w in plan.whole if not w.reason.startswith(WHOLE_BY_DESIGN)]
    return {"replicated": [[m, _first_line(r)] for m, r in plan.replicated],
            "whole": sorted({_first_line(w.reason)[:160] for w in plan.whole}),
            "gaps": [[n, _first_line(r)[:200]] for n, r in gaps],
            "fully_sharded": plan.replicated == () and not gaps}


def _first_line(e: object) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _run_job(job: dict, send) -> None:
    import torch
    from autotp.capture.tracer import capture

    try:
        if job["source"] == "hf":
            model, args, kwargs, kv = _build_hf(job["name"], job.get("kv"))
        else:
            out = importlib.import_module(job["module"]).build(job["kind"])
            model, args, kwargs = (*out, {}) if len(out) == 2 else out
            kv = None
    except Exception as e:  # noqa: BLE001
        send({"stage": "build", "error": _first_line(e)})
        return
    send({"stage": "build", "kv": kv})
    for mode, dtype in job["modes"]:
        t = time.perf_counter()
        try:
            model.train(mode == "train")
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                gm = capture(model, args, kwargs)[0]
        except Exception as e:  # noqa: BLE001
            send({"stage": "capture", "mode": f"{mode}/{dtype}", "error": _first_line(e)})
            continue
        ops, where = _ops_of(gm)
        msg = {"stage": "capture", "mode": f"{mode}/{dtype}", "ops": ops, "op_modules": where,
               "seconds": round(time.perf_counter() - t, 2)}
        if job.get("plans") and (mode, dtype) == PLAN_MODE:
            msg["plans"] = {str(tp): _plan_summary(gm, tp) for tp in TPS}
        send(msg)


def _worker(conn) -> None:
    import torch

    torch.set_num_threads(1)  # tiny models: one thread each, the machine is shared
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            _run_job(job, conn.send)
        except Exception:  # noqa: BLE001 - reported, and the worker stays up for the next model
            conn.send({"stage": "crash", "error": traceback.format_exc().strip().splitlines()[-1]})
        conn.send({"stage": "done"})


# -- in the parent -------------------------------------------------------------------------------------
class Workers:
    """One worker process at a time (spawned: no fork of a process that imported torch), replaced when a
    model overruns the time limit or kills it."""

    def __init__(self, timeout: float):
        self.timeout, self.ctx, self.proc, self.conn = timeout, mp.get_context("spawn"), None, None

    def _start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
        self.proc = self.conn = None

    def run(self, job: dict) -> list[dict]:
        """The worker's messages for ``job``; a last ``{"stage": "timeout" | "died"}`` where it did not finish."""
        if self.proc is None:
            self._start()
        self.conn.send(job)
        got = []
        while True:
            if not self.conn.poll(self.timeout):
                stage = got[-1]["stage"] if got else "start"
                nxt = "capture" if stage in ("build", "capture") else "build"
                got.append({"stage": "timeout", "error": f"no result within {self.timeout:.0f} s ({nxt})"})
                self._stop()
                return got
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the worker died (out of memory, a crash in C code)
                got.append({"stage": "died", "error": f"worker exited ({self.proc.exitcode})"})
                self._stop()
                return got
            if msg["stage"] == "done":
                return got
            got.append(msg)

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.conn.send(None)
                self.proc.join(10)
            except OSError:
                pass
            self._stop()


def resolve(name: str, modules: dict[str, str]):
    """``aten.cumsum.default`` -> the OpOverload (None where no module of ``modules`` defines it)."""
    import torch

    if name in modules:
        importlib.import_module(modules[name])
    ns, op, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except AttributeError:
        return None


def classify(name: str, modules: dict[str, str]) -> str:
    """The class of an op under the ``autotp`` this process imports (with or without torch's rules)."""
    from autotp.analysis.op_rules import op_rule

    op = resolve(name, modules)
    if op is None:  # a custom op whose library this process cannot load: no table of autotp's or torch's has it
        return "nothing"
    rule = op_rule(op)
    if rule is not None and rule.kind != "torch":
        return "autotp"
    try:
        from autotp.analysis.torch_rules import torch_rule_source
    except ImportError:  # the code without torch's rules: autotp's table only
        return "nothing"
    return {"strategy": "dtensor strategy", "decomposition": "dtensor decomposition"}.get(torch_rule_source(op),
                                                                                          "nothing")


def _summarise(msgs: list[dict]) -> dict:
    """A model's record from its worker's messages."""
    rec: dict = {"built": False, "captures": {}, "ops": []}
    ops: set[str] = set()
    for m in msgs:
        if m["stage"] == "build":
            rec["built"] = "error" not in m
            if "error" in m:
                rec["error"] = m["error"]
            elif m.get("kv"):
                rec["kv_heads_asked"] = m["kv"]
        elif m["stage"] == "capture":
            rec["captures"][m["mode"]] = m["error"] if "error" in m else f"ok ({m['seconds']} s)"
            ops.update(m.get("ops", ()))
            rec.setdefault("op_modules", {}).update(m.get("op_modules", {}))
            if "plans" in m:
                rec["plans"] = m["plans"]
        else:  # timeout, died, crash
            rec["error"] = m["error"]
            rec.setdefault("stopped", m["stage"])
    rec["ops"] = sorted(ops)
    return rec


def test_model_jobs() -> tuple[list[dict], dict[str, str]]:
    jobs, skipped = [], {}
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "support", "*_models.py"))):
        name = os.path.basename(path)[:-3]
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            skipped[name] = f"import failed: {_first_line(e)}"
            continue
        if not hasattr(mod, "KINDS") or not callable(getattr(mod, "build", None)):
            skipped[name] = "no KINDS / build(kind)"
            continue
        jobs += [{"source": "test", "module": name, "kind": k, "name": f"{name}:{k}", "modes": TEST_MODES}
                 for k in mod.KINDS]
    return jobs, skipped


def hf_families(args) -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if args.families:
        return [f for f in args.families.split(",") if f]
    if args.all:
        return names
    return [f for i, f in enumerate(names) if i % 5 == 0 or f in ALWAYS]


def _run_all(jobs: list[dict], timeout: float, progress: bool, n_workers: int = 1,
             on_record=None) -> dict[str, dict]:
    """Each job's summary, by name in the jobs' order; ``n_workers`` worker processes take jobs as they free up
    (each model is still captured alone in its process, so the records do not depend on how many run).
    ``on_record(records so far)``: called as each job finishes (the plans-only table is written then)."""
    import queue
    import threading

    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True, highlight=False)
    pool = [Workers(timeout) for _ in range(max(1, min(n_workers, len(jobs))))]
    todo: queue.Queue = queue.Queue()
    for i, job in enumerate(jobs):
        todo.put((i, job))
    recs: dict[int, dict] = {}
    lock = threading.Lock()

    def drain(workers: Workers) -> None:
        while True:
            try:
                i, job = todo.get_nowait()
            except queue.Empty:
                return
            t = time.perf_counter()
            rec = _summarise(workers.run(job))
            rec["seconds"] = round(time.perf_counter() - t, 1)
            with lock:
                recs[i] = rec
                if progress:
                    status = "ok" if rec["built"] and "error" not in rec else rec.get("error", "")[:90]
                    err.print(escape(f"[{len(recs)}/{len(jobs)}] {job['name']} {rec['seconds']} s {status}"))
                if on_record is not None:
                    on_record({j["name"]: recs[k] for k, j in enumerate(jobs) if k in recs})

    threads = [threading.Thread(target=drain, args=(w,)) for w in pool]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        for w in pool:
            w.close()
    return {job["name"]: recs[i] for i, job in enumerate(jobs) if i in recs}


def before_main(path_in: str, path_out: str) -> None:
    """In the subprocess that imports autotp without torch's rules: the op classes and the HF plans."""
    import autotp

    with open(path_in) as f:
        todo = json.load(f)
    assert os.path.realpath(autotp.__file__).startswith(os.path.realpath(BEFORE_TREE)), autotp.__file__
    ops = {op: classify(op, todo["op_modules"]) for op in todo["ops"]}
    jobs = [{"source": "hf", "name": f, "kv": kv, "modes": (PLAN_MODE,), "plans": True} for f, kv in todo["hf"]]
    models = _run_all(jobs, todo["timeout"], progress=True, n_workers=todo.get("jobs", 1))
    with open(path_out, "w") as f:
        json.dump({"autotp": autotp.__file__, "ops": ops, "hf": models}, f)


def before_ref() -> str:
    """The commit before torch's rules came in (the parent of the one that added torch_rules.py)."""
    added = subprocess.run(["git", "-C", ROOT, "log", "--diff-filter=A", "--format=%H", "--",
                            "autotp/analysis/torch_rules.py"], check=True, capture_output=True,
                           text=True).stdout.split()
    return f"{added[-1]}^" if added else "HEAD"  # not committed yet: HEAD is the code without them


def run_before(ops: list[str], modules: dict[str, str], hf: list[tuple[str, int]], timeout: float,
               n_workers: int = 1) -> dict:
    """The answers of the code without torch's rules: a worktree of that commit, imported by a subprocess."""
    ref = subprocess.run(["git", "-C", ROOT, "rev-parse", before_ref()], check=True, capture_output=True,
                         text=True).stdout.strip()
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", BEFORE_TREE, ref], check=True,
                   capture_output=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path_in, path_out = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
            with open(path_in, "w") as f:
                json.dump({"ops": ops, "op_modules": modules, "hf": hf, "timeout": timeout, "jobs": n_workers}, f)
            env = {**os.environ, "PYTHONPATH": BEFORE_TREE, "OP_COVERAGE_BEFORE": "1"}
            subprocess.run([sys.executable, os.path.abspath(__file__), "--before", path_in, path_out], env=env,
                           check=True, cwd=tmp)  # not the repo root: `import autotp` must find the worktree's
            with open(path_out) as f:
                return {**json.load(f), "commit": ref}
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", BEFORE_TREE], check=True)


def _counts(classes: dict[str, str], ops: set[str]) -> dict[str, int]:
    return {c: sum(classes[o] == c for o in ops) for c in CLASSES}


def report(test: dict, hf: dict, skipped: dict, before: dict, runtime: float, args) -> dict:
    import torch
    import transformers

    used: dict[str, list[str]] = {}
    groups = {"test models": test, "hf": hf}
    for recs in groups.values():
        for name, rec in recs.items():
            for op in rec["ops"]:
                used.setdefault(op, []).append(name)
    modules = {k: v for recs in groups.values() for rec in recs.values() for k, v in rec.get("op_modules", {}).items()}
    after = {op: classify(op, modules) for op in sorted(used)}
    was = {op: ("autotp" if before["ops"][op] == "autotp" else "nothing") for op in after}
    group_ops = {g: {op for rec in recs.values() for op in rec["ops"]} for g, recs in groups.items()}
    counts = {label: {"all": _counts(cls, set(used)), **{g: _counts(cls, ops) for g, ops in group_ops.items()}}
              for label, cls in (("after", after), ("before", was))}
    for rec in hf.values():
        rec.pop("ops")
    for name, rec in before["hf"].items():
        hf[name]["plans_before"] = rec.get("plans") or {"error": rec.get("error") or rec["captures"].get(
            "/".join(PLAN_MODE), "not captured")}

    def sharded(key: str, tp: int) -> int:
        return sum(bool(r.get(key, {}).get(str(tp), {}).get("fully_sharded")) for r in hf.values())

    captured = [n for n, r in hf.items() if str(r["captures"].get("/".join(PLAN_MODE), "")).startswith("ok")]
    return {
        "measured": ("distinct ops per class over the captures listed; HF plans at tp 2 and 4 on the "
                     "train/fp32 capture, now and without torch's rules; no parity runs"),
        "before_commit": before["commit"],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "runtime_s": round(runtime, 1),
        "modes": {"test models": ["/".join(m) for m in TEST_MODES], "hf": ["/".join(m) for m in HF_MODES]},
        "hf_selection": "all" if args.all else ("--families" if args.families else "default subset"),
        "counts": counts,
        "ops": {"after": {c: [o for o, k in after.items() if k == c] for c in CLASSES},
                "before": {c: [o for o, k in was.items() if k == c] for c in ("autotp", "nothing")}},
        "newly_placed": [o for o in after if was[o] == "nothing" and after[o] != "nothing"],
        "weight_ops": {o: k for o, k in after.items() if read_as_weight(o)},
        "nothing": {o: used[o] for o, k in after.items() if k == "nothing"},
        "skipped_test_modules": skipped,
        "test_models": {n: {k: v for k, v in r.items() if k != "ops"} | {"ops": len(r["ops"])}
                        for n, r in test.items()},
        "hf_summary": {
            "families": len(hf), "buildable": sum(r["built"] for r in hf.values()), "captured": len(captured),
            "fully_sharded": {key: {str(tp): sharded(k, tp) for tp in TPS}
                              for key, k in (("after", "plans"), ("before", "plans_before"))},
        },
        "hf": hf,
    }


def _mark(plan: dict | None, tp: int) -> str:
    if plan and "error" in plan:  # not captured by that code
        return "not captured"
    p = (plan or {}).get(str(tp))
    if p is None:
        return "—"
    if "error" in p:
        return "error"
    return "yes" if p["fully_sharded"] else f"no ({len(p['replicated'])} repl., {len(p['gaps'])} whole)"


def markdown(r: dict) -> str:
    c, s = r["counts"], r["hf_summary"]
    lines = [f"# Op coverage (torch {r['versions']['torch']}, transformers {r['versions']['transformers']})", "",
             f"Runtime {r['runtime_s']} s. Test models: {', '.join(r['modes']['test models'])}; Hugging Face "
             f"families ({r['hf_selection']}): {', '.join(r['modes']['hf'])}. Measured: {r['measured']}.", "",
             "## Distinct ops by rule", "",
             "| models | " + " | ".join(CLASSES) + " | before: autotp | before: nothing |",
             "|---|" + "---|" * (len(CLASSES) + 2)]
    for g in ("all", "test models", "hf"):
        lines.append(f"| {g} | " + " | ".join(str(c["after"][g].get(k, 0)) for k in CLASSES)
                     + f" | {c['before'][g]['autotp']} | {c['before'][g]['nothing']} |")
    lines += ["", f"Placed now, nothing before ({len(r['newly_placed'])}): "
              + ", ".join(f"`{o}`" for o in r["newly_placed"]), ""]
    for k in CLASSES[1:3]:
        lines.append(f"- {k}: " + ", ".join(f"`{o}`" for o in r["ops"]["after"][k]))
    lines += ["", "Read as weights outside the op table (column/row pairs, experts, vocab-parallel embeddings), "
              "before as now; the class above is the table's, for their other operands: "
              + ", ".join(f"`{o}` ({k})" for o, k in r["weight_ops"].items()), "",
              "A class says which table has the op; autotp still refuses an answer of torch's that is not local "
              "to a shard (a mutating, random or global-shape op, a partial result) and keeps the value whole."]
    lines += ["", "## Ops with no rule", "", "| op | models |", "|---|---|"]
    for op, models in r["nothing"].items():
        shown = ", ".join(models[:6]) + (f", … ({len(models)} in all)" if len(models) > 6 else "")
        lines.append(f"| `{op}`{' (read as expert weights)' if read_as_weight(op) else ''} | {shown} |")
    failed_tests = [f"{n} {m} ({why[:120]})" for n, t in r["test_models"].items()
                    for m, why in t["captures"].items() if not why.startswith("ok")]
    lines += ["", "Test model captures that failed: " + ("; ".join(failed_tests) or "—")]
    fs = s["fully_sharded"]
    lines += ["", "## Hugging Face families", "",
              f"{s['families']} families run, {s['buildable']} buildable, {s['captured']} captured (train/fp32). "
              f"Fully sharded: tp 2 {fs['before']['2']} → {fs['after']['2']}, tp 4 {fs['before']['4']} → "
              f"{fs['after']['4']} (before → now).", "",
              "| family | captures | tp 2 | tp 4 | tp 2 before | tp 4 before | left whole / replicated (now) |",
              "|---|---|---|---|---|---|---|"]
    for name, h in r["hf"].items():
        if not h["built"]:
            continue
        caps = ", ".join(f"{m}: {'ok' if v.startswith('ok') else 'failed'}" for m, v in h["captures"].items())
        if h.get("stopped"):
            caps += f" ({h['error']})"
        p2 = (h.get("plans") or {}).get("2") or {}
        why = [f"{n}: {w}" for n, w in p2.get("gaps", [])[:2]] + [f"{m}: {w}" for m, w in p2.get("replicated", [])[:2]]
        if p2.get("error"):
            why = [p2["error"]]
        lines.append(f"| {name} | {caps} | {_mark(h.get('plans'), 2)} | {_mark(h.get('plans'), 4)} | "
                     f"{_mark(h.get('plans_before'), 2)} | {_mark(h.get('plans_before'), 4)} | "
                     f"{'; '.join(w.replace('|', '/')[:140] for w in why) or '—'} |")
    failed = {n: h for n, h in r["hf"].items() if h["built"] and not any(
        v.startswith("ok") for v in h["captures"].values())}
    lines += ["", "Not captured: " + ("; ".join(f"{n} ({h.get('error') or next(iter(h['captures'].values()), '')})"
                                               [:200] for n, h in failed.items()) or "—"),
              "", "Not buildable: " + ("; ".join(f"{n} ({h.get('error', '')[:120]})" for n, h in r["hf"].items()
                                                 if not h["built"]) or "—")]
    if r["skipped_test_modules"]:
        skipped = r["skipped_test_modules"].items()
        lines += ["", "Test model modules skipped: " + "; ".join(f"{n} ({w})" for n, w in skipped)]
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


def _why(p2: dict) -> str:
    """What a tp plan leaves whole or replicated, for a table cell."""
    why = [f"{n}: {w}" for n, w in p2.get("gaps", [])[:2]] + [f"{m}: {w}" for m, w in p2.get("replicated", [])[:2]]
    if p2.get("error"):
        why = [p2["error"]]
    return "; ".join(w.replace("|", "/")[:140] for w in why) or "—"


def plans_only(args) -> None:
    """``--plans-only``: the Hugging Face families' plans at tp 2 and 4 alone (the train/fp32 capture; no test
    models, no eval/bf16 capture, no run without torch's rules), written to results/op_coverage_plans.{json,md}
    as each family finishes, so a run stopped early keeps what it measured."""
    import torch
    import transformers

    start = time.perf_counter()
    families = hf_families(args)
    out = os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    kept: dict = {}
    if args.update:  # the families run again replace their records; the others stay as the last run left them
        with open(os.path.join(out, "op_coverage_plans.json")) as f:
            last = json.load(f)
        again = families
        kept = {n: r for n, r in last["hf"].items() if n not in again}
        families = list(last["hf"]) + [f for f in again if f not in last["hf"]]

    def write(recs: dict) -> None:
        done = {**kept, **recs}
        done = {n: done[n] for n in families if n in done}
        captured = [n for n, r in done.items() if "plans" in r]
        full = {tp: sum(bool(done[n]["plans"].get(str(tp), {}).get("fully_sharded")) for n in captured) for tp in TPS}
        head = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                "hf_selection": ("all" if args.all else ("--families" if args.families else "default subset"))
                if not kept else f"{last['hf_selection']}; {len(again)} run again with --update",
                "runtime_s": round(time.perf_counter() - start, 1), "families": len(families), "run": len(done),
                "buildable": sum(r["built"] for r in done.values()), "captured": len(captured),
                "fully_sharded": {str(tp): n for tp, n in full.items()}}
        with open(os.path.join(out, "op_coverage_plans.json"), "w") as f:
            json.dump({**head, "hf": done}, f, indent=1)
        lines = [f"# Hugging Face plans at tp 2 and 4 (torch {torch.__version__}, transformers "
                 f"{transformers.__version__})", "",
                 f"`python benchmarks/op_coverage.py --plans-only` ({head['hf_selection']}): {len(done)} of "
                 f"{len(families)} families run in {head['runtime_s']} s, {head['buildable']} buildable, "
                 f"{len(captured)} captured (train/fp32). Fully sharded: tp 2 {full[2]}, tp 4 {full[4]} of "
                 f"{len(captured)}. A plan is fully sharded when nothing is replicated and every weight left whole is "
                 "whole by design (see the module docstring). No parity runs.", "",
                 "| family | capture | tp 2 | tp 4 | left whole / replicated at tp 2 (at tp 4 where it differs) |",
                 "|---|---|---|---|---|"]
        for name in families:
            if name not in done:
                continue
            h = done[name]
            cap = "not built: " + h.get("error", "")[:80] if not h["built"] else \
                str(h["captures"].get("/".join(PLAN_MODE), h.get("error", "")))[:80]
            plans = h.get("plans")
            why = "—"
            if plans:
                w2, w4 = _why(plans.get("2", {})), _why(plans.get("4", {}))
                why = w2 if w4 == w2 else f"{w2} (tp 4: {w4})"
            lines.append(f"| {name} | {cap.replace('|', '/')} | {_mark(plans, 2)} | {_mark(plans, 4)} | {why} |")
        with open(os.path.join(out, "op_coverage_plans.md"), "w") as f:
            f.write("\n".join(lines) + "\n")

    jobs = [{"source": "hf", "name": f, "modes": (PLAN_MODE,), "plans": True} for f in families if f not in kept]
    write(_run_all(jobs, args.timeout, progress=True, n_workers=args.jobs, on_record=write))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="every Hugging Face causal-LM family")
    ap.add_argument("--families", help="comma-separated Hugging Face model types (instead of the subset)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per build or capture")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes capturing models at once (default 1)")
    ap.add_argument("--plans-only", action="store_true",
                    help="the Hugging Face plans at tp 2 and 4 alone (results/op_coverage_plans.{json,md})")
    ap.add_argument("--update", action="store_true",
                    help="with --plans-only: run these families again, keep the other records of the last run")
    ap.add_argument("--before", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)  # the subprocess's side
    args = ap.parse_args()
    if args.before:
        before_main(*args.before)
        return
    if args.plans_only:
        plans_only(args)
        return
    start = time.perf_counter()
    jobs, skipped = test_model_jobs()
    test = _run_all(jobs, args.timeout, progress=True, n_workers=args.jobs)
    for name, rec in list(test.items()):
        if not rec["built"]:
            skipped[name] = f"build failed: {rec.get('error', '')}"
    hf_jobs = [{"source": "hf", "name": f, "modes": HF_MODES, "plans": True} for f in hf_families(args)]
    hf = _run_all(hf_jobs, args.timeout, progress=True, n_workers=args.jobs)
    ops = sorted({op for recs in (test, hf) for rec in recs.values() for op in rec["ops"]})
    planned = [(n, r.get("kv_heads_asked")) for n, r in hf.items() if "plans" in r]
    modules = {k: v for recs in (test, hf) for rec in recs.values() for k, v in rec.get("op_modules", {}).items()}
    before = run_before(ops, modules, planned, args.timeout, args.jobs)
    result = report(test, hf, skipped, before, time.perf_counter() - start, args)
    out = os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "op_coverage.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "op_coverage.md"), "w") as f:
        f.write(markdown(result))
    _print(result)


def _print(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="distinct ops by rule (before → now)")
    table.add_column("models")
    for k in CLASSES:
        table.add_column(k, justify="right")
    for g in ("all", "test models", "hf"):
        now, was = r["counts"]["after"][g], r["counts"]["before"][g]
        table.add_row(g, f"{was['autotp']} → {now['autotp']}", str(now["dtensor strategy"]),
                      str(now["dtensor decomposition"]), f"{was['nothing']} → {now['nothing']}")
    console = Console()
    console.print(table)
    s = r["hf_summary"]
    fs = s["fully_sharded"]
    console.print(f"HF: {s['families']} run, {s['buildable']} buildable, {s['captured']} captured; fully sharded "
                  f"tp 2 {fs['before']['2']} → {fs['after']['2']}, tp 4 {fs['before']['4']} → {fs['after']['4']}; "
                  f"{r['runtime_s']} s")


if __name__ == "__main__":
    main()
