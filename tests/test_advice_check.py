"""The dry run's advice for smaller cards, checked by compiling it (``advice_check``):
the lever-to-flags mapping, the fallback to the next lever when a compile misses its card,
the compile bound and cache, and the printed figures. Fast: a fake compile stands in for
the target's (``tests/test_gpu_compile.py`` compiles the advice for h100_sxm)."""

import dataclasses

import pytest

from jmem import finetune
from jmem import planner
from jmem._src.finetune import card_fit
from jmem._src.finetune.advice_check import AdviceCheck
from jmem._src.finetune.advice_check import Checked
from jmem._src.finetune.advice_check import checked
from jmem._src.finetune.advice_check import job_options

GiB = 2**30


def test_levers_map_to_the_jobs_options():
    config = finetune.FinetuneConfig.from_flat(batch_size=4, offload="optimizer")
    assert job_options(config, [{"remat": "offload"}]) == {"remat": "offload"}
    assert job_options(config, [{"offload": "params"}]) == {
        "offload": "params",
        "offload_dir": None,
    }
    both = job_options(config, [{"optimizer": "adamw_8bit"}, {"offload": "disk"}])
    assert both == {"optimizer": "adamw_8bit", "offload": "none", "offload_dir": ""}
    assert job_options(config, [{"batch_size": 1}]) == {"grad_accum": 4}
    assert job_options(config, [{"num_shards": 4}]) is None
    assert job_options(config, [{"lora": (8, "all")}]) is None


def test_checked_takes_the_offloaded_inputs_from_the_compile():
    """The compile's host temporaries (the offloaded layer inputs) move twice a step: the
    printed transfers are 2 x their bytes, not the planner's, and their seconds follow."""
    record = {
        "compiled": {"peak_bytes": 10 * GiB, "host_peak_bytes": 6 * GiB, "host_temp_bytes": 5e9},
        "transfers": {"activations": 1e9, "optimizer": 2e9},
    }
    c = checked(record, 25.0, 3.0)
    assert c.transfers == {"activations": 10e9, "optimizer": 2e9}
    assert c.seconds == pytest.approx(12 / 25) and c.host_bytes == 6 * GiB
    assert c.describe() == (
        "compiled: 10.00 GiB device + 6.00 GiB host, moves 12 GB per step (0.48 s at 25 GB/s "
        "--pcie-gbps)"
    )
    assert c.fits(12 * GiB) and not c.fits(11 * GiB)  # the 2 GB reserve


def _advice(*levers):
    """An ``Advice`` of ``(name, changes, planner GiB, host GiB)`` levers, all fitting."""
    sugg = tuple(
        planner.Suggestion(n, "", ch, int(t * GiB), True, int(h * GiB)) for n, ch, t, h in levers
    )
    return planner.Advice(False, "activations", GiB, 24 * GiB, 2 * GiB, None, sugg)


class _FakeCheck:
    """A stand-in for ``AdviceCheck``: compiled peaks by remat, cached, at most ``limit``."""

    def __init__(self, peaks, limit=3):
        self.peaks, self.limit, self.calls = peaks, limit, []

    def __call__(self, changes):
        remat = changes[0].get("remat")
        if remat in self.calls:
            return Checked(int(self.peaks[remat] * GiB), GiB, {"activations": 4e9}, 0.16, 25.0)
        if len(self.calls) >= self.limit or remat not in self.peaks:
            return None
        self.calls.append(remat)
        return Checked(int(self.peaks[remat] * GiB), GiB, {"activations": 4e9}, 0.16, 25.0)

    def why_not(self, changes):
        return "the dry run compiles at most 3 levers"


def test_a_lever_whose_compile_misses_its_card_gives_way_to_the_next():
    """The 24 GiB card's cheapest lever compiles to 31 GiB (the planner said 10): it is
    named as tried and missing, and the next lever, compiled under the card, is the
    advice, with its compiled device and host bytes and transfers; the record says so."""
    advice = _advice(
        ("selective remat", {"remat": "selective"}, 10, 0),
        ("offloaded inputs", {"remat": "offload_inputs"}, 12, 3),
    )
    fake = _FakeCheck({"selective": 31, "offload_inputs": 15})
    lines, record = card_fit.card_lines(
        40 * GiB, 33 * GiB, 2 * GiB, lambda card: advice, check=fake
    )
    assert fake.calls == ["selective", "offload_inputs"]  # 24 and 32 share the cache
    on24 = [ln for ln in lines if ln.startswith("  on a 24")]
    (i,) = [lines.index(ln) for ln in on24]
    assert lines[i].startswith("  on a 24/32 GiB card: --remat offload_inputs (offloaded inputs)")
    assert "compiled: 15.00 GiB device + 1.00 GiB host, moves 4 GB per step" in lines[i]
    assert "planner: 12.00 GiB" in lines[i] and "planner-only" not in lines[i]
    assert lines[i + 1].startswith("    tried --remat selective") and "31.00 GiB" in lines[i + 1]
    assert lines[i + 1].endswith("does not fit")
    assert record["levers"][24] == ["--remat offload_inputs (offloaded inputs)", 12 * GiB]
    assert record["checked"][24][1:3] == [15 * GiB, GiB] and record["checked"][24][-1]


def test_the_compile_bound_leaves_the_rest_planner_only():
    """Past the bound (here one compile) a lever is printed with the planner's figure,
    labelled planner-only and why; ``check=None`` (``--no-check-advice``) labels them all."""
    advice = _advice(
        ("selective remat", {"remat": "selective"}, 10, 0),
        ("full remat", {"remat": "full"}, 11, 0),
    )
    fake = _FakeCheck({"selective": 30, "full": 12}, limit=1)
    lines, record = card_fit.card_lines(40 * GiB, 25 * GiB, 2 * GiB, lambda c: advice, check=fake)
    assert lines[-2].startswith("  on a 24 GiB card: --remat full (full remat), planner: 11.00")
    assert lines[-2].endswith("(planner-only; not compiled: the dry run compiles at most 3 levers)")
    assert lines[-1].startswith("    tried --remat selective")
    assert record["checked"] == {24: None}
    lines, record = card_fit.card_lines(40 * GiB, 25 * GiB, 2 * GiB, lambda c: advice)
    assert lines[-1].endswith("planner: 10.00 GiB (planner-only)") and "checked" not in record


def test_the_check_compiles_each_configuration_once_and_at_most_its_limit(monkeypatch):
    config = finetune.FinetuneConfig.from_flat(batch_size=1, seq_len=64)
    check = AdviceCheck(config, None, limit=2)
    made = []

    def fake(options):
        made.append(options)
        return Checked(len(made) * GiB, 0, {}, 0.0, 25.0)

    monkeypatch.setattr(check, "_compile", fake)
    first = check([{"remat": "selective"}])
    assert check([{"remat": "selective"}]) is first and len(made) == 1
    assert check([{"remat": "offload"}]).peak_bytes == 2 * GiB
    assert check([{"remat": "none"}]) is None and len(made) == 2
    assert "at most 2" in check.why_not([{"remat": "none"}])
    assert "sharding" in check.why_not([{"num_shards": 2}])
    # a combination the job refuses is not compiled and does not count
    check = AdviceCheck(config, None, limit=1)
    monkeypatch.setattr(check, "_compile", fake)
    assert check([{"offload": "params", "remat": "none"}]) is None and len(made) == 2
    assert "refuses" in check.why_not([{"offload": "params", "remat": "none"}])
    assert check.compiles == 0 and dataclasses.is_dataclass(first)


def test_a_compiled_lever_over_host_memory_says_so():
    """The planner put the lever's host bytes at 0.5 GiB, within --host-memory 0.75 GiB;
    its compile holds 1 GiB in host memory: the line says the compile needs more."""
    advice = _advice(("offloaded inputs", {"remat": "offload_inputs"}, 12, 0.5))
    fake = _FakeCheck({"offload_inputs": 15})
    lines, _ = card_fit.card_lines(
        40 * GiB, 25 * GiB, 2 * GiB, lambda c: advice, host_memory=int(0.75 * GiB), check=fake
    )
    assert lines[-1].startswith("  on a 24 GiB card: --remat offload_inputs (offloaded inputs);")
    assert (
        "1.00 GiB host, moves 4 GB per step (0.16 s at 25 GB/s --pcie-gbps), which needs 1.00 "
        "GiB of host memory, above --host-memory 0.75 GiB; planner: 12.00 GiB"
    ) in lines[-1]


def test_a_memory_the_step_misses_gets_the_same_compiled_advice():
    """``--dry-run --memory SIZE`` missed: the cheapest lever for ``SIZE``, compiled
    (``card_fit.memory_lines``), recorded as ``advice``; without a check, planner-only."""
    advice = _advice(
        ("selective remat", {"remat": "selective"}, 10, 0),
        ("offloaded inputs", {"remat": "offload_inputs"}, 12, 3),
    )
    fake = _FakeCheck({"selective": 31, "offload_inputs": 15})
    lines, record = card_fit.memory_lines(24 * GiB, 2 * GiB, advice, check=fake)
    assert lines[0].endswith("(the planner's advice; compiled for the target):")
    assert lines[1].startswith("  --remat offload_inputs (offloaded inputs); compiled: 15.00")
    assert lines[2].startswith("    tried --remat selective") and lines[2].endswith("not fit")
    assert record["lever"] == ["--remat offload_inputs (offloaded inputs)", 12 * GiB]
    assert record["checked"][1] == 15 * GiB
    lines, record = card_fit.memory_lines(24 * GiB, 2 * GiB, advice)
    assert lines[1].endswith("planner: 10.00 GiB (planner-only)") and record["checked"] is None
    lines, record = card_fit.memory_lines(24 * GiB, 2 * GiB, None)
    assert "no lever" in lines[1] and record == {"lever": None, "checked": None}
