"""benchmarks/peer_tunix.py: its command line and table without Tunix; with Tunix and qwix
installed (the ``tunix`` extra), a ``--quick`` run at a tiny size whose first losses on both
sides are those of random-init models on random tokens (~ln(vocab))."""

import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import peer_tunix  # noqa: E402


def test_parse_args_lists_settings_and_quick_is_short():
    args = peer_tunix.parse_args(["--quick", "--remat", "none, layer", "--dtypes", "bfloat16"])
    assert (args.rounds, args.steps, args.warmup) == (2, 3, 1)
    assert args.remat == ["none", "layer"] and args.dtypes == ["bfloat16"]
    assert peer_tunix.REMAT["layer"] == ("full", "DECODER")  # per-layer remat on both sides
    assert peer_tunix.REMAT["none"] == ("none", "NONE")


@pytest.mark.parametrize("flag", [["--remat", "selective"], ["--dtypes", "float16"]])
def test_parse_args_refuses_unknown_setting(flag, capsys):
    with pytest.raises(SystemExit):
        peer_tunix.parse_args(flag)
    assert "dtypes: ['bfloat16', 'float32'], remat: ['layer', 'none']" in capsys.readouterr().err


def test_qwix_tile_divides_the_contraction_axis_closest_to_64():
    # q/k/v/gate/up contract hidden 256, o_proj the head dim 32, down_proj 688 = 16 x 43
    assert [peer_tunix.qwix_tile(n) for n in (256, 32, 688, 4096, 14336)] == [64, 32, 43, 64, 64]


def test_table_has_one_row_per_setting():
    mem = {"temp": 3 * 2**20, "argument": 2**20, "output": 0, "alias": 0, "peak": 4 * 2**20}
    row = {
        "remat": "layer",
        "dtype": "float32",
        "tok_per_s": {"jmem": 2000.0, "tunix": 1000.0},
        "ratio": 2.0,
        "round_ratios": [1.9, 2.1],
        "memory_bytes": {"jmem": mem, "tunix": mem},
        "first_loss": {"jmem": 5.5, "tunix": 5.6},
        "ln_vocab": 5.545,
    }
    args = peer_tunix.parse_args(["--quick"])
    lines = peer_tunix.table([row], args).splitlines()
    assert lines[-1] == (
        "| layer | float32 | 2,000 | 1,000 | 2.00 | 1.90 2.10 | 3.0 / 3.0 | 1.0 / 1.0 | "
        "5.500 / 5.600 |"
    )


def test_main_without_tunix_names_the_extra(monkeypatch):
    monkeypatch.setattr(peer_tunix, "TUNIX_MISSING", "ModuleNotFoundError: No module named 'tunix'")
    with pytest.raises(SystemExit, match=r'pip install -e "\.\[tunix\]"'):
        peer_tunix.main(["--quick"])


@pytest.mark.slow
def test_quick_run_first_losses_near_ln_vocab(tmp_path):
    pytest.importorskip("tunix", reason="Tunix is the peer (the tunix extra)")
    pytest.importorskip("qwix", reason="qwix quantizes the Tunix side (the tunix extra)")
    out = tmp_path / "peer_tunix.json"
    argv = ["--quick", "--batch", "2", "--seq", "16", "--dtypes", "float32", "--out", str(out)]
    (row,) = peer_tunix.main(argv + ["--remat", "layer"])
    for name in ("jmem", "tunix"):
        loss = row["first_loss"][name]
        assert math.isfinite(loss) and abs(loss - math.log(256)) < 0.15, (name, loss)
        assert row["memory_bytes"][name]["temp"] > 0 and row["tok_per_s"][name] > 0
    assert row["tunix_model"] == "tunix.models.llama3.model.Llama3"
    assert row["qwix_nf4_tiles"] == {
        "q_proj|k_proj|v_proj|gate_proj|up_proj": 64,
        "o_proj": 32,
        "down_proj": 43,
    }
    assert out.exists()
