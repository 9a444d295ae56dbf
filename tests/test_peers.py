"""The peer adapters (`harness.targets.peers`): each loads and declares itself on any machine; each
installed one passes every check on inputs where its peer is right, and shows each finding its
known file explains on a case that exhibits it. Peers that are not installed skip, saying so.

Runs on the session's pools (the plugin's `harness_pools` fixture), no pools of its own.
"""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.base import levels
from harness.base.errors import TargetError
from harness.cases.case import DistillCase, KernelCase, LinearCase, WrapperCase, parse_case
from harness.cases.kl import KLCase
from harness.checks.findings import BEYOND_USE
from harness.checks.findings import IN_USE as IN_USE_MARK
from harness.checks.known import load as load_known
from harness.checks.use import parse_use
from harness.driver.explorer import strategy_for
from harness.driver.runner import Runner
from harness.targets import load_target
from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers import peers

PEERS = {p.name: p for p in peers()}
MEGATRON = "harness.targets.peers.megatron"
# Every kernel check on the log-prob path; input-integrity is asserted on its own below.
LOG_PROB_CHECKS = {"crash", "empty-input", "collectives", "values", "gradients", "grad-flags",
                   "shapes-dtypes", "finite", "chunk-invariance", "tp-invariance"}

# Ordinary inputs: float32 rows, chunked and not, at TP 1 and 2 (TP 2 exercises parallel_state's
# group for verl, the vocab gather for TRL). Every peer's values are right here; any other finding
# must be one its known file explains (Megatron's float32 in-place writes, the fused one's bf16
# gradients).
CLEAN = [KernelCase(tp=tp, T=7, v_local=5, regime=regime, chunk_size=chunk, with_entropy=ent, seed=31 * tp + i)
         for tp in (1, 2) for i, (regime, chunk, ent) in
         enumerate([("normal", -1, True), ("peaked", 3, True), ("huge", -1, False), ("normal", 7, False)])]
# The same at the fused-linear level; one hidden size and vocab shard, so a compiled peer (Cut
# Cross-Entropy) compiles for few shapes.
CLEAN += [LinearCase(tp=tp, T=T, H=16, v_local=8, regime=regime, chunk_size=chunk, with_entropy=ent, seed=41 * tp + T)
          for tp in (1, 2) for T, regime, chunk, ent in [(7, "normal", -1, True), (9, "peaked", 4, False)]]
# And at the wrapper level (the NeMo-RL peers), packed batches at TP 1 and 2, chunked and not; the
# last at a V_local so small that the wrapper's O(T) int64 bookkeeping (targets padded and rolled)
# is as large as the chunking's saving, which memory-chunk-passthrough must not take for an
# ignored chunk size.
CLEAN += [WrapperCase(tp=tp, v_local=6, total_lengths=(5, 8), response_lengths=(2, 5), chunk_size=chunk, seed=tp)
          for tp, chunk in ((1, -1), (2, 4))]
CLEAN += [WrapperCase(tp=2, v_local=3, total_lengths=(1, 3, 8), response_lengths=(0, 0, 0), chunk_size=2,
                      regime="peaked", seed=3)]
# And at the distillation level: a divergence from a teacher pass's top-k, fitted to what each peer takes.
CLEAN += [DistillCase(tp=tp, T=5, v_local=6, teacher="given", k=3, seed=51 * tp) for tp in (1, 2)]
# And at the KL-estimator level: every estimator near the reference, masked and reduced, at TP 1.
CLEAN += [KLCase(tp=1, T=12, kind=kind, reduction=reduction, mask="random", seed=7 + i)
          for i, (kind, reduction) in enumerate([("k1", "token_mean"), ("k2", "none"), ("k3", "token_mean")])]
# One case per known finding or finding beyond the peer's use (its HARNESS_USE), with the check that
# must report it: the finding is real, shows, and is explained (known, or beyond the use).
WITNESSES: dict[str, list[tuple[str, str]]] = {
    "megatron": [("kernel:tp=2,T=5,v_local=4,with_entropy=0,seed=1594", "input-integrity"),
                 ("kernel:tp=1,T=5,v_local=4,with_entropy=0,seed=1,context=accumulate", "gradients"),
                 ("kernel:tp=2,T=5,v_local=4,with_entropy=0,seed=1,context=two_calls", "crash")],
    "megatron_fused": [("kernel:tp=1,T=3,v_local=4,with_entropy=0,seed=1", "gradients"),
                       ("kernel:tp=1,T=0,v_local=4,with_entropy=0", "empty-input")],
    "verl": [("kernel:tp=2,T=6,v_local=5,regime=neginf,seed=1", "finite"),
             ("kernel:tp=1,T=4,v_local=8,dtype=bf16,seed=2", "shapes-dtypes"),
             ("kernel:tp=2,T=4,v_local=8,seed=3", "input-integrity"),
             ("kernel:tp=1,T=5,v_local=4,with_entropy=0,seed=1,context=accumulate", "gradients"),
             ("kernel:tp=1,T=4,v_local=8,seed=4,context=two_calls", "crash")],
    "verl_chunked": [("kernel:tp=1,T=5,v_local=4,with_entropy=0,seed=1,context=accumulate", "gradients"),
                     ("kernel:tp=2,T=0,v_local=4", "grad-flags")],
    "verl_fused_linear": [("linear:tp=1,T=6,H=16,v_local=7,dtype=bf16,seed=3", "shapes-dtypes"),
                          ("linear:tp=1,T=6,H=64,v_local=7,dtype=fp16,regime=wide,chunk_size=9,seed=964", "values")],
    "cce": [("linear:tp=2,T=7,H=16,v_local=8,dtype=bf16,regime=wide,seed=7", "values")],
    "nemo_rl": [("kernel:tp=2,T=5,v_local=4,with_entropy=0,seed=1,layout=transposed", "crash"),
                ("wrapper:tp=1,v_local=3,total_lengths=3/6,response_lengths=2/2,temperature=1.3,with_entropy=0,"
                 "layout=transposed", "crash"),
                ("kernel:tp=1,T=0,v_local=4,with_entropy=0,chunk_size=2", "empty-input")],
    "nemo_rl_unpacked": [("wrapper:tp=2,v_local=3,total_lengths=4/6,response_lengths=2/3,with_entropy=0,"
                          "layout=transposed", "crash")],
    "nemo_rl_loss": [("wrapper:tp=2,v_local=3,total_lengths=4/6,response_lengths=2/3,with_entropy=0,"
                      "layout=transposed", "crash")],
    "verl_loss": [("wrapper:tp=1,v_local=4,total_lengths=3/4,response_lengths=2/2,entropy_coef=0,with_entropy=1,seed=1",
                   "entropy-coef-rule"),
                  ("wrapper:tp=2,v_local=64,total_lengths=9/7,response_lengths=4/3,chunk_size=4,with_entropy=0,seed=2",
                   "memory-chunk-effect")],
    "ms_swift": [("kernel:tp=1,T=2,v_local=8,regime=neginf,seed=1", "finite"),
                 ("kernel:tp=2,T=3,v_local=4,loss_terms=entropy,seed=2", "gradients"),
                 ("kernel:tp=1,T=0,v_local=4", "empty-input"),
                 ("kernel:tp=1,T=1,v_local=4,dtype=bf16", "shapes-dtypes")],
    "prime_rl": [("linear:tp=1,T=1,H=8,v_local=4", "crash"),
                 ("linear:tp=1,T=1,H=8,v_local=4,dtype=bf16,with_entropy=0,with_entropy_grad=0", "values")],
    "skyrl": [("kernel:tp=2,T=6,v_local=5,chunk_size=4,seed=14,layout=transposed", "crash"),
              ("kernel:tp=2,T=6,v_local=5,regime=neginf,seed=1", "finite"),
              ("kernel:tp=2,T=8,v_local=64,dtype=bf16,seed=21", "shapes-dtypes")],
    "nemo_rl_distill": [("distill:tp=2,T=4,v_local=4,teacher=given,k=3,renormalize=0,seed=1", "values"),
                        ("distill:tp=2,T=3,v_local=4,teacher=given,k=2,regime=neginf,seed=2", "finite"),
                        ("distill:tp=1,T=0,v_local=4,function=topk,k=2,requires_grad=0", "empty-input")],
    "ms_swift_gkd": [("distill:tp=2,T=3,v_local=4,kind=reverse_kl,seed=1", "gradients"),
                     ("distill:tp=2,T=3,v_local=3,function=topk,k=5,requires_grad=0", "crash"),
                     ("distill:tp=2,T=3,v_local=4,kind=jsd,regime=neginf,seed=2", "finite"),
                     ("distill:tp=1,T=3,v_local=4,dtype=bf16,seed=3", "shapes-dtypes")],
    "skyrl_mtp": [("distill:tp=2,T=4,v_local=6,kind=soft_ce,teacher=topk,k=2,seed=1", "values"),
                  ("distill:tp=1,T=3,v_local=8,kind=soft_ce,regime=neginf,seed=2", "finite")],
    "verl_kl": [("kl:tp=1,T=4,kind=k1,reduction=token_mean,mask=empty,seed=1", "finite"),
                ("kl:tp=1,T=6,kind=k3,regime=fartail,seed=2", "values"),
                ("kl:tp=1,T=5,kind=k2,dtype=bf16,seed=3", "shapes-dtypes")],
    "openrlhf": [("kl:tp=1,T=4,kind=k1,reduction=token_mean,mask=empty,seed=1", "finite"),
                 ("kl:tp=1,T=6,kind=k3,regime=fartail,seed=2", "values")],
    "trl": [("kernel:tp=2,T=6,v_local=5,regime=neginf,seed=1", "finite"),
            ("kernel:tp=1,T=4,v_local=8,dtype=bf16,seed=2", "shapes-dtypes"),
            ("kernel:tp=1,T=0,v_local=4", "empty-input")],
}
# Defects in the peer's own use: each case must give a new finding in use, of this family.
IN_USE: dict[str, list[tuple[str, str]]] = {
    "verl_chunked": [("kernel:tp=1,T=5,v_local=8,chunk_size=2,seed=5", "crash")],
    "verl_loss": [("wrapper:tp=1,v_local=4,total_lengths=1/1,response_lengths=0/0,entropy_coef=absent,"
                   "temperature=absent,chunk_size=1,with_entropy=1,top_p=none,regime=normal,seed=0", "crash")],
    "ms_swift": [("kernel:tp=2,T=1,v_local=4,with_entropy=0,with_entropy_grad=0", "gradients [log-prob]")],
    "verl_fused_linear": [("linear:tp=1,T=1,H=8,v_local=4,with_entropy=0,with_entropy_grad=0,frozen=weight",
                           "frozen-input-work [frozen=weight]")],
}


def _installed(name: str):
    peer = PEERS[name]
    if peer.missing():
        pytest.skip(f"peer {name} not installed (no {', '.join(peer.missing())}): {peer.install}")
    if peer.cuda_only:
        pytest.skip(f"peer {name} runs only on CUDA")
    return peer


def _runner(pools, name: str) -> Runner:
    """The installed peer's runner on the session's pools, with its known file."""
    peer = _installed(name)
    runner = Runner(peer.spec, pools=pools)
    if peer.known is not None:  # a peer without conventions of its own has no known file
        runner.verdicts.known = load_known(peer.known)
    return runner


# The families of the defects in a peer's own use (`IN_USE`), as any case of theirs may show them.
IN_USE_FAMILIES = {"ms_swift": {"gradients [log-prob]", "tp-invariance [log-prob]"}, "verl_chunked": {"crash"},
                   "verl_loss": {"crash"},
                   "verl_fused_linear": {"frozen-input-work [frozen=weight]"}}


def _explained(runner: Runner, case) -> set[str]:
    """The checks that found something in `case`; fails on any finding neither the known file nor
    the peer's use (HARNESS_USE: beyond it) explains, but a defect in its own use (`IN_USE_FAMILIES`)."""
    before = len(runner.verdicts.known_findings)
    _, new = runner.check(case)  # the findings no entry explains
    expected = IN_USE_FAMILIES.get(runner.target.spec.rpartition(".")[2], set())
    in_use = [f for f in new if f.use != BEYOND_USE and f.family not in expected]
    assert not in_use, f"unexplained: {in_use[0].check}: {in_use[0].message}\n{in_use[0].repro}"
    return {f.check for f in runner.verdicts.known_findings[before:]} | {f.check for f in new}


def test_every_adapter_loads_and_declares_itself() -> None:
    """On any machine (peers imported lazily), with what `harness peers` needs to list it."""
    assert {"megatron", "megatron_fused", "verl", "verl_chunked", "trl", "liger", "verl_fused_linear", "cce",
            "verl_linear_ce", "nemo_rl", "nemo_rl_unpacked"} <= set(PEERS)
    for peer in PEERS.values():
        target = load_target(peer.spec)
        assert target.levels and peer.upstream and peer.install and peer.summary
        # Every adapter ships a valid --known file: its trainer's main is green under `--fail-on new`
        # where it has no defect in its own use (an empty file: nothing found, or not run on CPU).
        assert peer.known is not None, f"{peer.name} has no {peer.name}.known.toml"
        load_known(peer.known)


def test_every_adapter_declares_a_script_or_why_it_has_none() -> None:
    """`harness repro --script` has a call for every adapter, or the adapter's reason it cannot have one."""
    for peer in PEERS.values():
        script = importlib.import_module(peer.spec).HARNESS.script
        assert script and (set(script) & set(levels.all_levels()) or str(script.get("none", "")).strip()), peer.name


def test_cuda_only_peer_is_refused_on_cpu_with_its_reason() -> None:
    for name in ("liger", "verl_linear_ce"):
        assert PEERS[name].cuda_only
        with pytest.raises(TargetError, match="runs only on CUDA"):
            Runner(PEERS[name].spec)


def test_every_witness_is_a_known_or_beyond_use_check() -> None:
    """The witnesses below name checks of the peer's known file or its declared use, so none tests
    a finding nothing explains."""
    for name, witnesses in WITNESSES.items():
        peer = PEERS[name]
        named = {c for e in load_known(peer.known).entries for c in e.checks} if peer.known else set()
        use = load_target(peer.spec).use
        assert all(check in named or any(not u.get("check") or check in u["check"] for u in use)
                   for _, check in witnesses), name


def test_every_peer_declares_its_use_citing_its_callers() -> None:
    """Each adapter's declared use is valid (`checks.use`) and each entry cites a file and line."""
    import re

    for peer in PEERS.values():
        module = importlib.import_module(peer.spec)
        assert isinstance(getattr(module, "HARNESS", None), Declaration), peer.name
        for entry in parse_use(peer.spec, module.HARNESS.use):
            assert re.search(r"[\w/.-]+\.\w+:\d+", entry.reason), f"{peer.name}: {entry.reason}"


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(IN_USE))
def test_defects_in_the_peer_s_own_use_are_findings_in_use(harness_pools, name: str) -> None:
    """Never hidden in a known file: a new finding, in the peer's use, of its own family."""
    runner = _runner(harness_pools, name)
    for spec, family in IN_USE[name]:
        _, new = runner.check(parse_case(spec))
        assert any(f.family == family and f.use == IN_USE_MARK for f in new), (spec, [(f.family, f.use) for f in new])


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(WITNESSES))
def test_right_values_and_nothing_unexplained_on_ordinary_inputs(harness_pools, name: str) -> None:
    runner = _runner(harness_pools, name)
    cases = [c for c in CLEAN if c.level in runner.target.levels]
    assert cases
    for case in cases:
        assert "values" not in _explained(runner, case), case.spec()


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(WITNESSES))
def test_known_findings_show_and_are_explained(harness_pools, name: str) -> None:
    """Each witness case gives its finding, and every finding it gives is explained by the known file."""
    runner = _runner(harness_pools, name)
    for spec, check in WITNESSES[name]:
        assert check in _explained(runner, parse_case(spec)), f"{spec}: no {check} finding"


def test_megatron_declares_log_prob_only() -> None:
    target = load_target(MEGATRON)
    assert target.levels == ("kernel",)
    assert not target.supports("entropy") and not target.supports("keep_mask")


@settings(max_examples=100, database=None, deadline=None)
@given(st.data())
def test_megatron_draws_nothing_it_cannot_compute(data) -> None:
    case = data.draw(strategy_for(SimpleNamespace(target=load_target(MEGATRON)), "kernel", (1, 2, 4)))
    assert not case.with_entropy and case.mask == "none"


def test_megatron_says_what_it_does_not_provide() -> None:
    from harness.targets.peers.megatron import calculate_log_probs_and_entropy

    with pytest.raises(NotImplementedError, match="computes no entropy"):
        calculate_log_probs_and_entropy(None, None, None, with_entropy=True)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_megatron_passes_log_prob_checks(harness_pools, tp: int, dtype: str) -> None:
    """Values at float32 scale in every input dtype (megatron upcasts before its math), gradients,
    collectives and the invariances, at TP 1, 2 and 4; peaked rows, -inf entries, chunk sizes, T == 0."""
    megatron = Runner(MEGATRON, pools=harness_pools)
    cases = [KernelCase(tp=tp, T=7, v_local=5, dtype=dtype, regime=regime, chunk_size=chunk, with_entropy=False,
                        seed=11 * tp + i)
             for i, (regime, chunk) in enumerate([("normal", -1), ("peaked", 3), ("neginf", -1), ("huge", 2)])]
    cases += [KernelCase(tp=tp, T=0, v_local=3, dtype=dtype, with_entropy=False),
              KernelCase(tp=tp, T=5, v_local=4, dtype=dtype, with_entropy=False, requires_grad=False, seed=5)]
    for case in cases:
        _, findings = megatron.check(case, only=LOG_PROB_CHECKS)
        assert not findings, f"{findings[0].check}: {findings[0].message}\n{findings[0].repro}"


@pytest.mark.distributed
def test_megatron_float32_logits_are_overwritten(harness_pools) -> None:
    """A finding about megatron-core 0.16.1 itself (Megatron-LM PR #1594, still open): `.float()` is a
    no-op on float32 input, so its in-place `-=`/`exp(out=)`/`div_` write the softmax into the
    caller's logits. Half-precision inputs are copied by the upcast and stay intact."""
    megatron = Runner(MEGATRON, pools=harness_pools)
    for dtype, mutated in (("fp32", True), ("bf16", False)):
        _, findings = megatron.check(KernelCase(tp=2, T=5, v_local=4, dtype=dtype, with_entropy=False, seed=1594),
                                     only={"input-integrity"})
        assert bool(findings) == mutated, dtype
        if mutated:
            assert "values changed after forward" in findings[0].message


NEMO_RL = "harness.targets.peers.nemo_rl"


def test_nemo_rl_declares_what_it_does_not_claim_and_how_to_enable_it() -> None:
    """Loads without NeMo-RL (imported lazily); log-probs only, zigzag CP only; `harness peers`
    says how to put a NeMo-RL tree on PYTHONPATH when it is absent."""
    from dataclasses import replace

    from harness.base.levels import fit
    from harness.commands.peers import _why_not
    from harness.targets.peers.nemo_rl import calculate_log_probs_and_entropy, get_log_probs_and_entropy

    target = load_target(NEMO_RL)
    assert target.levels == ("kernel", "wrapper")
    assert not any(target.supports(c) for c in ("entropy", "keep_mask", "allgather_cp"))
    allgather = WrapperCase(tp=1, v_local=4, total_lengths=(5,), response_lengths=(2,), cp=2, cp_layout="allgather")
    zigzag = allgather.replace(cp_layout="zigzag", with_entropy=False)
    assert fit(allgather, target.on("cuda").supports) == zigzag
    assert fit(allgather, target.on("cpu").supports) == zigzag.replace(context="no_grad")
    absent = replace(PEERS["nemo_rl"], requires=("nemo_rl_absent_for_this_test.distributed",))
    assert "PYTHONPATH" in _why_not(absent, "cpu")
    with pytest.raises(NotImplementedError, match="computes? no entropy"):
        calculate_log_probs_and_entropy(None, None, None, with_entropy=True)
    with pytest.raises(NotImplementedError, match="load-balanced"):
        get_log_probs_and_entropy(None, args=SimpleNamespace(allgather_cp=True), unconcat_tokens=[],
                                  total_lengths=[], response_lengths=[])


def test_nemo_rl_cp_gradient_is_drawn_only_where_it_can_run() -> None:
    """NeMo-RL's CP backward moves an index to CUDA: on CPU a CP case with a gradient becomes the same
    case without autograd (its forward, and the training path's forward, are still checked); on
    CUDA it stays as drawn. A CP-1 case keeps its gradient everywhere."""
    from harness.base.levels import fit

    train = WrapperCase(tp=1, v_local=5, total_lengths=(6, 4), response_lengths=(3, 2), with_entropy=False, cp=2,
                        context="accumulate")
    target = load_target(NEMO_RL)
    assert fit(train, target.on("cpu").supports) == train.replace(context="no_grad")
    assert fit(train, target.on("cuda").supports) == train
    assert fit(train.replace(cp=1), target.on("cpu").supports) == train.replace(cp=1)
    assert not target.supports("cp_gradient"), "device-agnostic: only where every device has it"


def test_a_compiled_routine_compiles_each_signature_as_a_fresh_process_would(monkeypatch) -> None:
    """A worker runs a whole run's sizes through one process; a routine declared compiled (Cut
    Cross-Entropy, fullgraph=True) must not fail a case because earlier cases used up Dynamo's
    recompile limit, nor run a dynamic-shape graph only because another size came first. A routine
    not declared compiled keeps torch's automatic dynamic shapes (the second size compiles a dynamic
    graph), and no recompile limit either: what it compiles itself never falls back to eager only
    because a worker has seen many signatures."""
    import torch
    import torch._dynamo

    from harness.engine.executor import compile_per_signature

    graphs: list[str] = []

    def backend(gm, example_inputs):
        graphs.append(" ".join(str(getattr(t, "shape", t)) for t in example_inputs))
        return gm.forward

    fn = torch.compile(lambda x: (x * 2).sum(), fullgraph=True, backend=backend)
    compiled, eager = load_target("harness.targets.peers.cce"), load_target(MEGATRON)
    assert not compiled.supports("eager") and eager.supports("eager")
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    torch._dynamo.reset()
    try:
        for n in [*range(1, 6), 3]:  # one new size per case, then a size seen before
            compile_per_signature(compiled)
            fn(torch.ones(n))
        assert graphs == [f"torch.Size([{n}])" for n in range(1, 6)], "one static graph per size, reused"
        torch._dynamo.reset()
        graphs.clear()
        for n in range(1, 6):
            compile_per_signature(eager)
            fn(torch.ones(n))
        assert len(graphs) == 2 and "s" in graphs[1], f"torch's defaults: the second size goes dynamic {graphs}"
        for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.int64):  # past the limit of 2
            compile_per_signature(eager)
            fn(torch.ones(3, dtype=dtype))
        assert len(graphs) == 6, f"every signature compiled, none left to run eagerly: {graphs}"
    finally:
        torch._dynamo.reset()


@pytest.mark.distributed
def test_nemo_rl_wrappers_give_the_oracle_s_pieces(harness_pools) -> None:
    """Both NeMo-RL wrappers (packed, and unpacked one sequence per call) through their adapters: right log-probs and gradients of every response, at
    TP 1 and 2, chunked and not, with a temperature, a length-1 prompt and an empty response, on
    the training path and under no_grad; and each CP rank's zigzag pieces at CP 2 and 4 under
    no_grad (NeMo-RL's CP backward needs CUDA), with samples shorter than 2 * cp and responses
    wholly on one rank's chunks. Nothing at all is found on these contiguous inputs."""
    cases = [WrapperCase(tp=tp, v_local=5, total_lengths=lengths, response_lengths=responses, chunk_size=chunk,
                         temperature=temp, with_entropy=False, context=context, seed=7 * tp + i)
             for tp in (1, 2) for i, (lengths, responses, chunk, temp, context) in enumerate([
                 ((6, 2, 9), (3, 1, 0), -1, None, "train"), ((5, 7), (4, 2), 3, 0.7, "train"),
                 ((4, 3), (2, 2), 2, 1.3, "no_grad")])]
    cases += [WrapperCase(tp=tp, v_local=5, total_lengths=(9, 3, 2, 12), response_lengths=(4, 1, 0, 2),
                          chunk_size=chunk, with_entropy=False, context="no_grad", cp=cp, seed=cp + tp)
              for tp, cp, chunk in ((1, 2, -1), (2, 2, 3), (1, 4, 2))]
    for name in ("nemo_rl", "nemo_rl_unpacked"):
        runner = _runner(harness_pools, name)
        for case in cases:
            _, findings = runner.check(case)
            assert not findings and not runner.verdicts.known_findings, f"{name}: {case.spec()}"


def test_matrix_cells_say_pass_known_new_and_why_not() -> None:
    from harness.report import matrix

    finding = {"check": "values", "message": "rank 0 log_prob off\nmore", "repro": "python -m harness repro X"}
    result = {"levels": ["kernel"], "capabilities": {"entropy": False}, "tp": [1, 2],
              "checks": {"values": {"kernel": {"applied": 9, "failed": 1, "known": 0}},
                         "gradients": {"kernel": {"applied": 5, "failed": 0, "known": 2}},
                         "crash": {"kernel": {"applied": 9, "failed": 0, "known": 0}},
                         "memory-metric-only": {}, "memory-backward-frees": {"kernel": {"applied": 3, "failed": 0}}},
              "findings": [finding],
              "known_findings": [{**finding, "check": "gradients", "known": "[gradients]: bf16 cast"}]}
    cells = matrix.peer_cells(result)
    assert cells["values"]["state"] == "finding" and cells["values"]["repro"] == finding["repro"]
    assert cells["gradients"]["state"] == "known" and cells["gradients"]["reasons"] == ["[gradients]: bf16 cast"]
    assert cells["crash"] == {"state": "pass", "applied": 9}
    assert cells["wrapper"] == {"state": "n/a", "note": "no wrapper level"}
    assert cells["memory"] == {"state": "pass", "applied": 3}  # the family: any of its checks that ran
    assert cells["grad-flags"] == {"state": "n/a", "note": "applies to no case it can take (no entropy)"}
    page = {"profile": "smoke", "tp": [1], "seed": 0, "date": "d", "harness": "h", "columns": matrix.columns(),
            "elapsed_s": 2.0, "cpu_s": 3.0,
            "peers": [{"name": "p", "status": "ran", "cases": 9, "elapsed_s": 1.0, "cpu_s": 1.5, "profile": "smoke",
                       "cells": cells, "upstream": ["u"], "summary": "s"},
                      {"name": "q", "status": "skipped", "reason": "runs only on CUDA", "upstream": ["v"],
                       "summary": "t"}]}
    for text in (matrix.render_markdown(page), matrix.render_html(page)):
        assert "NEW FINDING (1/9)" in text and "known (2/5)" in text and "bf16 cast" in text
        assert "runs only on CUDA" in text and "python -m harness repro X" in text
        assert "1.0 s (smoke)" in text and "2.0 s wall, 3.0 s CPU" in text  # each peer's time, and the whole's


@pytest.mark.distributed
def test_peers_command_writes_the_matrix(tmp_path) -> None:
    """End to end: one peer checked in its own `harness check` process, one skipped with its reason."""
    import json

    from harness.cli import main

    out = tmp_path / "m"
    # megatron-core's findings are all beyond its use (Megatron never makes those inputs), and its shipped
    # known file (megatron.known.toml) explains each: none is new, exit 0
    assert main(["peers", "--only", "megatron", "liger", "--profile", "smoke", "--tp", "1", "--out", str(out)]) == 0
    page = json.loads((out / "peers.json").read_text())
    rows = {p["name"]: p for p in page["peers"]}
    assert rows["liger"]["status"] == "skipped" and rows["liger"]["reason"]
    megatron = rows["megatron"]
    assert megatron["status"] == "ran" and megatron["cases"] > 0 and megatron["findings"] == 0
    assert megatron["known_findings"] > 0
    assert megatron["profile"] == "smoke" and megatron["elapsed_s"] > 0 and megatron["cpu_s"] > 0
    assert megatron["cells"]["input-integrity"]["state"] == "known"  # #1594, on logits Megatron never reads again
    assert not [c for c in megatron["cells"].values() if c["state"] == "finding"]
    assert (out / "peers.html").read_text().startswith("<!DOCTYPE html>") and (out / "megatron.json").exists()


def test_a_tree_without_the_peer_s_routine_is_refused_not_run(tmp_path, monkeypatch) -> None:
    """A commit before the routine existed (or after it moved): an adapter that imports inside its
    calls would turn every case into an ImportError `crash`. The runner refuses the target instead,
    reading the tree's source without importing it (the package `__init__` imports a training
    stack), so `harness history` marks the commit untestable."""
    import importlib

    from harness.base.errors import TargetError
    from harness.driver.runner import Runner
    from harness.targets.peers import absent_here

    spec = "harness.targets.peers.verl"
    importlib.import_module(spec)
    pkg = tmp_path / "verl" / "utils" / "megatron"
    pkg.mkdir(parents=True)
    (tmp_path / "verl" / "__init__.py").write_text("import ray  # a training stack: never imported by the probe\n")
    (tmp_path / "verl" / "utils" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "tensor_parallel.py").write_text("def unrelated():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    why = absent_here(spec)
    assert why and "none of its routines" in why and "vocab_parallel_entropy in" in why, why
    with pytest.raises(TargetError, match="none of its routines"):
        Runner(spec)
    (pkg / "tensor_parallel.py").write_text("from math import fsum as vocab_parallel_entropy\n")
    (tmp_path / "verl" / "__init__.py").write_text("")  # found, its module is imported (in a child): it must import
    assert absent_here(spec) is None
    # An adapter that loads its routine's own file finds its tree itself (prime-rl's under src/), and
    # without one says where to get it rather than running every case into its ImportError.
    prime = importlib.import_module("harness.targets.peers.prime_rl")
    if not prime.SOURCE.roots():
        assert "source is not on sys.path" in (absent_here("harness.targets.peers.prime_rl") or "")
    (tmp_path / "prime-rl" / "src" / "prime_rl" / "trainer").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "prime-rl"))
    assert absent_here("harness.targets.peers.prime_rl") is None


def test_a_tree_whose_routine_does_not_import_here_is_refused_not_run(tmp_path, monkeypatch) -> None:
    """The routine is in the tree, but its package does not import here (verl's 2025 commits import
    `pkg_resources`, which this setuptools lacks): every case would be that ImportError as a `crash`.
    The module is imported in a child process, this one's torch and environment untouched, and the
    target refused with the error; an import that hangs is refused too."""
    import sys

    from harness.targets import peers as peers_module
    from harness.targets.peers import absent_here

    def tree(name: str, init: str) -> None:
        (tmp_path / name / "fakepeer").mkdir(parents=True)
        (tmp_path / name / "fakepeer" / "__init__.py").write_text(init)
        (tmp_path / name / "fakepeer" / "ops.py").write_text("def log_probs(logits, tokens):\n    return logits\n")
        monkeypatch.syspath_prepend(str(tmp_path / name))

    monkeypatch.setitem(sys.modules, "fake_adapter", SimpleNamespace(HARNESS=Declaration(peer=PeerInfo(
        requires=("fakepeer",), install="put fakepeer on PYTHONPATH",
        upstream=("fakepeer.ops.log_probs", "fakepeer.ops.entropy")))))
    tree("broken", "import a_module_that_does_not_exist\n")
    assert absent_here("fake_adapter") == ("fake_adapter: fakepeer.ops cannot be imported here: "
                                           "ModuleNotFoundError: No module named 'a_module_that_does_not_exist'")
    assert "fakepeer" not in sys.modules
    tree("fine", "")
    assert absent_here("fake_adapter") is None
    monkeypatch.setattr(peers_module, "IMPORT_PROBE_TIMEOUT_S", 1)
    tree("hangs", "import time\ntime.sleep(60)\n")
    assert absent_here("fake_adapter") == "fake_adapter: fakepeer.ops cannot be imported here: " \
                                          "its import did not finish within 1 s"


def test_a_folder_named_like_the_peer_is_not_the_peer(tmp_path, monkeypatch) -> None:
    """A folder of the peer's package name in the current directory (a namespace package holding none
    of its modules) does not make the peer present: `peers --list` and `peers` say its routine is not
    here, instead of checking it and reporting its ImportError on every case."""
    import sys

    from harness.commands.peers import _why_not
    from harness.targets.peers import Peer, absent_here

    (tmp_path / "fakepeer").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "fake_adapter", SimpleNamespace(HARNESS=Declaration(peer=PeerInfo(
        requires=("fakepeer",), install="pip install fakepeer", upstream=("fakepeer.ops.log_probs",)))))
    why = absent_here("fake_adapter")
    assert why and "none of its routines" in why and "log_probs in fakepeer.ops" in why, why
    peer = Peer("fake", "fake_adapter", ("fakepeer",), "pip install fakepeer", ("fakepeer.ops.log_probs",), "", False, None)
    assert (_why_not(peer, "cpu") or "").startswith("its routine is not here: "), _why_not(peer, "cpu")


def test_peers_exits_as_check_does(tmp_path, monkeypatch) -> None:
    """0 without a new finding on any peer, 1 with one, 2 when a peer's run gave no result."""
    from harness.cli import main
    from harness.commands import peers as command
    from harness.report import matrix

    outcome = {"status": "ran", "findings": 0}
    cells = matrix.peer_cells({"checks": {}})  # every family, none applied

    def run(peer, ns, workdir):
        (workdir / f"{peer.name}.json").write_text("{}")
        if outcome["status"] != "ran":
            return {"status": "error", "reason": "did not finish within --peer-timeout 1800 s"}
        return {"status": "ran", "cases": 3, "elapsed_s": 1.0, "cpu_s": 1.0, "profile": "smoke", "cells": cells,
                "findings": outcome["findings"], "known_findings": 1, "beyond_use": 0, "command": "check"}
    monkeypatch.setattr(command, "_run_peer", run)
    monkeypatch.setattr(command, "_why_not", lambda peer, device: None)
    argv = ["peers", "--only", "megatron", "--out", str(tmp_path / "m")]
    assert main(argv) == 0
    outcome["findings"] = 2
    assert main(argv) == 1
    outcome["status"] = "error"
    assert main(argv) == 2


def test_peers_list_says_which_adapter_does_not_import_and_lists_the_rest(tmp_path, monkeypatch, capsys) -> None:
    """NeMo-RL's tree on PYTHONPATH whose routine's file imports a dependency not installed here
    (hydra): its adapter fails at import. `peers --list` still lists every peer, that one saying
    what is missing, and exits 0."""
    import sys

    from harness.cli import main

    loss = tmp_path / "nemo_rl" / "algorithms" / "loss"
    loss.mkdir(parents=True)
    (tmp_path / "nemo_rl" / "distributed").mkdir()
    (loss / "loss_functions.py").write_text("from hydra_not_installed_here import LossFunction\n\n\n"
                                            "class DistillationLossFn(LossFunction):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "harness.targets.peers.nemo_rl_distill", raising=False)
    assert main(["peers", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    said = {line.split()[0]: line for line in lines if not line.startswith(" ")}
    assert set(said) == set(PEERS)
    assert "its adapter does not import here (ModuleNotFoundError: " in said["nemo_rl_distill"], said["nemo_rl_distill"]
    assert "imports hydra_not_installed_here: No module named 'hydra_not_installed_here'" in said["nemo_rl_distill"]
    assert any("NeMo-RL's top-k distillation" in line for line in lines)  # its summary, read from its source
