"""``scripts/tools/plot_routes.py --seeds``: routes set against the first route seed by seed."""

from __future__ import annotations

import json

import pytest

from scripts.tools import plot_routes


def run(communicator, seed, accuracies, **params):
    spec = {"compressor": "onebit", "communicator": communicator, **params}
    return {"workload": "mnist", "status": "ok", "seed": seed, "compression": json.dumps(spec),
            "epochs": [{"test_accuracy": a} for a in accuracies]}


def test_each_route_is_set_against_the_first_route_of_its_own_seed(tmp_path):
    """Seed 0's gathered runs are averaged (two runs of one seed differ); a seed without a
    gathered run is left out; final and last-3 differences are in points."""
    runs = [run("allgather", 0, [0.80, 0.84, 0.86, 0.88]), run("allgather", 0, [0.80, 0.82, 0.84, 0.86]),
            run("allgather", 1, [0.80, 0.85, 0.85, 0.85]),
            run("alltoall", 0, [0.80, 0.83, 0.85, 0.86], owner_bits=2),
            run("alltoall", 1, [0.80, 0.85, 0.85, 0.84], owner_bits=2),
            run("alltoall", 2, [0.80, 0.80, 0.80, 0.80], owner_bits=2)]
    diffs = plot_routes.seed_differences(runs)
    by_seed = diffs["onebit"]["communicator=alltoall, owner_bits=2"]
    assert sorted(by_seed) == [0, 1]
    # seed 0 gathered: final (0.88 + 0.86) / 2, last 3 (0.86 + 0.84) / 2
    assert by_seed[0] == pytest.approx((100 * (0.86 - 0.87), 100 * ((0.83 + 0.85 + 0.86) / 3 - 0.85)))
    assert by_seed[1] == pytest.approx((-1.0, -1 / 3))
    table = plot_routes.seeds_table(diffs)
    assert "| onebit | communicator=alltoall, owner_bits=2 | 2 | -1.00 / -1.00 | **-1.00** |" in table
    plot_routes.plot_seeds(diffs, str(tmp_path / "seeds.png"))
    assert (tmp_path / "seeds.png").stat().st_size > 10_000


def test_a_route_with_no_seed_of_the_first_route_has_no_row():
    """A route whose seeds the first route never ran (here owner_bits=2 at seed 1; in the docs, a
    file whose gathered runs name their communicator beside one whose runs do not) is left out of
    the table, not a mean of nothing."""
    runs = [run("allgather", 0, [0.8, 0.8, 0.8]), run("alltoall", 0, [0.8, 0.8, 0.9]),
            run("alltoall", 1, [0.8, 0.8, 0.8], owner_bits=2)]
    table = plot_routes.seeds_table(plot_routes.seed_differences(runs))
    assert table.count("| onebit |") == 1
    assert "| onebit | communicator=alltoall | 1 | +10.00 | **+10.00** | +3.33 | **+3.33** |" in table
