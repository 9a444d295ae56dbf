"""Case specs as a user types them: an unknown field or value is refused, by `repro` and by `check`
(a --known file's conditions), with exit 2 and the valid ones; the valid values come from one
place (the tuples of cases/case.py, carried by the fields), and `harness fields` and the docs list
them."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from harness.cases import case as case_module
from harness.cases.case import CASE_TYPES, CONTEXTS, LAYOUTS, LOSS_TERMS, KernelCase, parse_case, valid_values
from harness.cli import main
from harness.commands import fields as fields_command

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("spec, words", [
    ("kernel:tp=2,T=3,v_local=4,loss_terms=logprob", "valid: both, log_prob, entropy"),
    ("kernel:tp=2,T=3,v_local=4,layout=strided", "valid: " + ", ".join(LAYOUTS)),
    ("linear:tp=1,T=2,H=3,v_local=4,regime=huge", "valid: normal, peaked, wide"),
    ("wrapper:tp=1,v_local=3,total_lengths=3,response_lengths=1,top_p=all", "valid: none, nucleus, partial"),
    ("kernel:tp=2,T=3,v_local=4,with_entropy=2", "with_entropy takes 0|1"),
    ("kernel:tp=2,T=3,v_local=4,loss_term=both", "loss_terms=both|log_prob|entropy"),
    ("kernel:tp=2,T=3", "lacks v_local"),
])
def test_a_bad_spec_names_what_is_valid(spec, words):
    with pytest.raises(ValueError) as exc:
        parse_case(spec)
    assert words in str(exc.value)


@pytest.mark.parametrize("spec", ["kernel:tp=2,T=3,v_local=4,loss_terms=logprob",
                                  "kernel:tp=2,T=3,v_local=4,bogus=1"])
def test_repro_refuses_an_unknown_field_or_value_with_exit_2(spec, capsys):
    assert main(["repro", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("harness: error:") and "both" in err and "log_prob" in err and "entropy" in err


@pytest.mark.parametrize("where, words", [
    ('{ loss_terms = "logprob" }', "valid: both, log_prob, entropy"),
    ('{ regime = ["peaked", "hot"] }', "unknown regime value(s) ['hot']; valid: normal, peaked, huge"),
    ('{ loss_term = "both" }', "unknown case field(s) ['loss_term']"),
])
def test_check_refuses_an_unknown_field_or_value_in_known_conditions(where, words, tmp_path, capsys):
    known = tmp_path / "known.toml"
    known.write_text(f'[[known]]\ncheck = "values"\nwhere = {where}\nreason = "r"\n')
    assert main(["check", "--known", str(known), "--profile", "smoke"]) == 2
    assert words in capsys.readouterr().err


def test_valid_values_come_from_the_tuples_of_the_case_module():
    """One place: the fields carry the module's tuples themselves, so a value added there is valid."""
    kernel = valid_values(KernelCase)
    assert kernel["loss_terms"] == LOSS_TERMS and kernel["context"] == CONTEXTS and kernel["layout"] == LAYOUTS
    for cls in CASE_TYPES.values():
        # A level's case class lives in its own module (`cases/kl.py`) or in `cases/case.py`: its tuples.
        module = sys.modules[cls.__module__]
        tuples = {v for m in (case_module, module) for k, v in vars(m).items() if k.isupper() and isinstance(v, tuple)}
        tuples.add(tuple(case_module.DTYPES))
        assert set(valid_values(cls).values()) <= tuples, cls
        for name, values in valid_values(cls).items():  # every default is valid, every other string not
            default = cls.__dataclass_fields__[name].default
            assert default in values
            with pytest.raises(ValueError, match="valid: "):
                dataclasses.replace(_example(cls), **{name: "no-such-value"})


def _example(cls):
    return parse_case({"kernel": "kernel:tp=1,T=1,v_local=1", "linear": "linear:tp=1,T=1,H=1,v_local=1",
                       "wrapper": "wrapper:tp=1,v_local=1,total_lengths=2,response_lengths=1",
                       "distill": "distill:tp=1,T=1,v_local=1", "kl": "kl:tp=1,T=1",
                       "linear_distill": "linear_distill:tp=1,T=1,H=1,v_local=2"}[cls.level])


def test_fields_lists_every_field_and_its_values_per_level(capsys):
    assert main(["fields"]) == 0
    out = capsys.readouterr().out
    for level, cls in CASE_TYPES.items():
        block = out.split(f"{level} cases")[1].split("\n\n")[0]
        for f in dataclasses.fields(cls):
            assert f"  {f.name} " in block, (level, f.name)
        for name, values in valid_values(cls).items():
            assert "|".join(values) in block, (level, name)


def test_the_docs_list_the_fields_as_generated():
    doc = (REPO / "docs" / "check-your-routine.md").read_text()
    assert fields_command.fields_markdown() in doc, "regenerate with `python -m harness fields --markdown`"
