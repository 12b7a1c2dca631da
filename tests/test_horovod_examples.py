"""scripts/tools/horovod_examples.py changes Horovod's TF2 examples by exact substitutions (the examples
themselves come from a Horovod checkout, which this suite does not have): each must apply, a text
that has moved fails loudly, and nothing but the named lines changes."""

from __future__ import annotations

import pytest

from scripts.tools import horovod_examples

EXAMPLES = ("tensorflow2_synthetic_benchmark.py", "tensorflow2_mnist.py", "tensorflow2_keras_mnist.py")


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_edit_applies_and_nothing_else_changes(example):
    edits = horovod_examples.edits(example, "grace.topk()", 20, 64)
    source = "\n".join(f"line {i}\n{old}" for i, (old, _) in enumerate(edits)) + "\nthe rest\n"
    changed = horovod_examples.changed(source, example, "grace.topk()", 20, 64)
    expected = "\n".join(f"line {i}\n{new}" for i, (_, new) in enumerate(edits)) + "\nthe rest\n"
    assert changed == expected
    assert any("grace.topk()" in new for _, new in edits)  # the compression line is one of them


@pytest.mark.parametrize("example", EXAMPLES)
def test_a_moved_text_fails_loudly(example):
    edits = horovod_examples.edits(example, "grace.topk()", 20, 64)
    required = [old for old, _ in edits if old not in horovod_examples.OPTIONAL]
    source = "\n".join(old for old, _ in edits if old != required[0])
    with pytest.raises(SystemExit, match="is not there"):
        horovod_examples.changed(source, example, "grace.topk()", 20, 64)


def test_horovods_own_compressions_are_the_baselines_and_names_are_checked():
    assert horovod_examples.compression_expression("horovod-none") == "hvd.Compression.none"
    assert horovod_examples.compression_expression("horovod-fp16") == "hvd.Compression.fp16"
    assert horovod_examples.compression_expression("twobit") == "grace.twobit()"
    with pytest.raises(SystemExit, match="'topkk' is not one of"):
        horovod_examples.compression_expression("topkk")


def test_the_table_says_which_ran_from_the_printed_lines():
    printed = ["tensorflow2_mnist.py                 topk           ok     Step #0\tLoss: 2.3",
               "tensorflow2_keras_mnist.py           horovod-none   FAILED Exit code: 1",
               "tensorflow2_mnist.py                 horovod-none   ok     Step #0\tLoss: 2.2",
               "a stray line"]
    results = [r for r in map(horovod_examples.parse_line, printed) if r is not None]
    assert results == [("tensorflow2_mnist.py", "topk", True),
                       ("tensorflow2_keras_mnist.py", "horovod-none", False),
                       ("tensorflow2_mnist.py", "horovod-none", True)]
    assert horovod_examples.markdown(results).splitlines() == [
        "| compression | `tensorflow2_mnist.py` | `tensorflow2_keras_mnist.py` |",
        "|---|---|---|",
        "| topk | ok |  |",
        "| horovod-none | ok | fails |"]
