"""A simulation study's record as its table (``scripts/studies/simulation_records.py``), worked by
hand: the final accuracy of each run, per seed, the mean where a set-up ran several, and only the
settings that tell the runs apart."""

import pytest

from scripts.studies import simulation_records


def test_a_record_becomes_a_row_per_setup_with_the_final_accuracy_per_seed_and_their_mean():
    record = {"what": "a study", "runs": [
        {"spec": "fp32", "workers": 2, "lr": None, "seed": 0, "accuracy": [0.5, 0.80]},
        {"spec": "fp32", "workers": 2, "lr": None, "seed": 1, "accuracy": [0.5, 0.90]},
        {"spec": "topk", "workers": 2, "lr": 0.003, "seed": 0, "accuracy": [0.4, 0.7], "note": "x"},
        {"spec": "topk", "workers": 2, "lr": None, "local_adam": True, "seed": 1,
         "accuracy": [0.4, 0.6]},
    ]}
    assert simulation_records.markdown(record) == "\n".join([
        "| set-up (final test accuracy after 2 passes) | seed 0 | seed 1 | mean |",
        "|---|---:|---:|---:|",
        "| fp32 | 0.8000 | 0.9000 | **0.8500** |",  # (0.8 + 0.9) / 2; workers is every run's: left out
        "| topk, lr 0.003 | 0.7000 |  |  |",  # one seed: no mean; the note is not a setting
        "| topk, local adam |  | 0.6000 |  |",  # a flag by its name
    ])


def test_a_variant_named_in_words_keeps_them_and_a_single_seed_has_no_mean_column():
    record = {"runs": [
        {"variant": "randomk at lr 5e-4", "lr": 0.0005, "seed": 0, "accuracy": [0.3, 0.25, 0.8613]},
        {"variant": "randomk, --held 0.9", "lr": 0.001, "seed": 0, "accuracy": [0.1, 0.2, 0.2628]},
    ]}
    assert simulation_records.markdown(record) == "\n".join([
        "| set-up (final test accuracy after 3 passes) | seed 0 |",
        "|---|---:|",
        "| randomk at lr 5e-4 | 0.8613 |",  # its words say lr already
        "| randomk, --held 0.9, lr 0.001 | 0.2628 |",
    ])


def test_a_setting_is_left_out_only_where_the_variants_words_name_it():
    record = {"runs": [
        {"variant": "already trained", "lr": 0.1, "seed": 0, "accuracy": [0.5]},  # "lr" in a word
        {"variant": "already trained", "lr": 0.2, "seed": 0, "accuracy": [0.6]},
    ]}
    assert simulation_records.markdown(record).splitlines()[2:] == [
        "| already trained, lr 0.1 | 0.5000 |", "| already trained, lr 0.2 | 0.6000 |"]


def test_two_runs_the_table_cannot_tell_apart_are_refused():
    record = {"runs": [{"spec": "topk", "seed": 0, "accuracy": [0.5]},
                       {"spec": "topk", "seed": 0, "accuracy": [0.6]}]}
    with pytest.raises(ValueError, match="two runs of 'topk' at seed 0"):
        simulation_records.markdown(record)


def test_seeds_are_columns_in_number_order():
    record = {"runs": [{"spec": "a", "seed": s, "accuracy": [s / 100]} for s in (10, 2, 0)]}
    assert simulation_records.markdown(record).splitlines()[0] == (
        "| set-up (final test accuracy after 1 pass) | seed 0 | seed 2 | seed 10 | mean |")


def test_runs_of_different_lengths_say_so():
    record = {"runs": [{"spec": "a", "seed": 0, "accuracy": [0.1, 0.2]},
                       {"spec": "b", "seed": 0, "accuracy": [0.3]}]}
    assert simulation_records.markdown(record).splitlines()[0] == (
        "| set-up (final test accuracy after 1/2 passes, as each set-up ran) | seed 0 |")


def test_routes_are_set_against_the_gathered_run_of_their_own_compressor_workers_and_seed():
    """Worked by hand: each route's final (and last-3 mean) less the gathered run's of the same
    compressor, parameters but the route's, workers and seed, in points; a measured figure
    (``owner_entries_vs_fixed_k``) does not split a set-up; the gathered runs give their finals."""
    def run(spec, seed, accuracy, workers=4, **extra):
        return {"spec": spec, "workers": workers, "seed": seed, "accuracy": accuracy, **extra}

    record = {"runs": [
        run("fp32", 0, [0.5, 0.5, 0.9]),  # no route: not in the table
        # four passes, its best not its last: the final is the last, the last 3 the last three
        run("topk:ratio=0.01;communicator=allgather", 0, [0.95, 0.80, 0.82, 0.84]),
        # a patched gathered run is not the reference of the unpatched ones
        run("topk:ratio=0.01;communicator=allgather", 1, [0.1, 0.1, 0.1], variant="patched"),
        run("topk:ratio=0.01;communicator=allgather", 1, [0.70, 0.80, 0.90]),
        run("topk:ratio=0.01;communicator=allgather", 0, [0.6, 0.6, 0.6], workers=8),
        run("topk:ratio=0.01;communicator=alltoall", 0, [0.81, 0.81, 0.81]),
        run("topk:ratio=0.01;communicator=alltoall", 0, [0.5, 0.5, 0.7], workers=8),
        run("topk:ratio=0.01;owner_ratio=0.02;communicator=alltoall", 1, [0.70, 0.80, 0.93]),
        run("topk:ratio=0.01;communicator=alltoall", 0, [0.8, 0.8, 0.8], variant="patched",
            owner_entries_vs_fixed_k=0.9),
        run("topk:ratio=0.01;communicator=alltoall", 1, [0.8, 0.8, 0.8], variant="patched",
            owner_entries_vs_fixed_k=0.8),
    ]}
    table = simulation_records.against_gathering(record).split("\n")
    assert table[0] == ("| set-up, against gathering at the same seed: final (last 3 passes), points "
                        "| seed 0 | seed 1 | mean |")
    assert table[1:] == [
        "|---|---:|---:|---:|",
        "| topk:ratio=0.01;communicator=allgather, workers 4 (final accuracy) | 0.8400 | 0.9000 | – |",
        # a variant of gathering is measured against gathering: 0.1 - 0.9; 0.1 - 0.8
        "| topk:ratio=0.01;communicator=allgather, patched, workers 4 |  | -80.00 (-70.00) "
        "| **-80.00** (-70.00) |",
        "| topk:ratio=0.01;communicator=allgather, workers 8 (final accuracy) | 0.6000 |  | – |",
        # 0.81 - 0.84 = -3 points; last 3: 0.81 - 0.82 = -1
        "| topk:ratio=0.01;communicator=alltoall, workers 4 | -3.00 (-1.00) |  | **-3.00** (-1.00) |",
        # 0.7 - 0.6; (0.5 + 0.5 + 0.7) / 3 - 0.6
        "| topk:ratio=0.01;communicator=alltoall, workers 8 | +10.00 (-3.33) |  | **+10.00** (-3.33) |",
        "| topk:ratio=0.01;owner_ratio=0.02;communicator=alltoall, workers 4 |  | +3.00 (+1.00) "
        "| **+3.00** (+1.00) |",
        # seed 0: -4 (-2); seed 1: -10 (0): mean -7 (-1)
        "| topk:ratio=0.01;communicator=alltoall, patched, workers 4 | -4.00 (-2.00) | -10.00 (+0.00) "
        "| **-7.00** (-1.00) |",
    ]
    twice = {"runs": record["runs"] + [run("topk:ratio=0.01;communicator=allgather", 1, [0.5])]}
    with pytest.raises(ValueError, match="two gathered runs of 'topk:ratio=0.01;communicator=allgather' "
                                         "at seed 1"):
        simulation_records.against_gathering(twice)
    record["runs"].append(run("dgc:communicator=alltoall", 0, [0.8]))
    with pytest.raises(ValueError, match="no gathered run beside 'dgc:communicator=alltoall' at seed 0"):
        simulation_records.against_gathering(record)
