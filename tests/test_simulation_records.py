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
