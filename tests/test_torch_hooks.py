"""PyTorch's own DDP hooks as the benchmarks name and configure them (scripts/torch_hooks.py), and
how compare.py and quality.py set DDP beside Horovod: which compressions run under which engine,
the frameworks ``--engines`` gives, and the quality table of DDP's runs."""

from __future__ import annotations

import re

import pytest

from scripts import compare, quality, torch_hooks

MLP = [(512, 784), (512,), (256, 512), (256,), (10, 256), (10,)]  # the mnist MLP, torch.nn.Linear


def test_powersgd_sends_both_factors_of_each_matrix_and_vectors_whole():
    # rank 1: (512 + 784) + 512 + (256 + 512) + 256 + (10 + 256) + 10 floats
    assert torch_hooks.payload_bytes("torch-powersgd-r1", MLP) == 4 * (1296 + 512 + 768 + 256 + 266 + 10)
    assert torch_hooks.payload_bytes("torch-powersgd-r2", MLP) == 4 * (2592 + 512 + 1536 + 256 + 532 + 10)
    # a convolution is viewed as out-channels x the rest: 64 x (3 * 7 * 7)
    assert torch_hooks.payload_bytes("torch-powersgd-r1", [(64, 3, 7, 7)]) == 4 * (64 + 147)
    # where the factors are no smaller than the matrix, it travels whole
    assert torch_hooks.payload_bytes("torch-powersgd-r2", [(3, 3)]) == 4 * 9


def test_fp16_halves_and_per_bucket_payloads_are_not_guessed():
    numel = 512 * 784 + 512 + 256 * 512 + 256 + 10 * 256 + 10
    assert torch_hooks.payload_bytes("torch-fp16", MLP) == 2 * numel
    for name in torch_hooks.PER_BUCKET:
        with pytest.raises(ValueError, match="depends on DDP's buckets"):
            torch_hooks.payload_bytes(name, MLP)
    assert torch_hooks.warmup_steps("torch-powersgd-r1") == 2 and torch_hooks.warmup_steps("torch-fp16") == 0


def test_an_unknown_hook_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="'torch-fp8': not one of torch-fp16, torch-bf16"):
        torch_hooks.check("torch-fp8")
    with pytest.raises(ValueError, match="torch-fp8"):
        torch_hooks.payload_bytes("torch-fp8", MLP)


def test_powersgd_state_is_configured_as_the_docs_recommend():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    group = object()
    hook, state = torch_hooks.make("torch-powersgd-r2", process_group=group)
    assert hook is powerSGD_hook.powerSGD_hook and state.process_group is group
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter, state.min_compression_rate,
            state.use_error_feedback, state.warm_start) == (2, 2, 1, True, True)
    assert torch_hooks.make("torch-batched-powersgd-r1")[0] is powerSGD_hook.batched_powerSGD_hook
    hook, state = torch_hooks.make("torch-fp16", process_group=group)
    assert hook is default_hooks.fp16_compress_hook and state is group  # the group is its state


def test_each_engine_runs_its_own_baselines():
    assert compare.parse_compression("torch-powersgd-r1") == "torch-powersgd-r1"
    assert compare.label("torch-powersgd-r1") == "torch-powersgd-r1"
    topk = compare.parse_compression("topk:ratio=0.01")
    assert [fw for fw in ("torch", "tf", "ddp") if compare.runs_under(fw, "hvd-fp16")] == ["torch", "tf"]
    assert [fw for fw in ("torch", "tf", "ddp") if compare.runs_under(fw, "torch-fp16")] == ["ddp"]
    assert [fw for fw in ("torch", "tf", "ddp") if compare.runs_under(fw, topk)] == ["torch", "tf", "ddp"]
    assert [fw for fw in ("torch", "tf", "ddp") if compare.runs_under(fw, "fp32")] == ["torch", "tf", "ddp"]


def test_engines_give_the_rows_frameworks_and_bad_ones_are_named():
    assert compare.engine_frameworks("torch,tf", "horovod") == ["torch", "tf"]
    assert compare.engine_frameworks("torch,tf", "horovod,ddp") == ["torch", "tf", "ddp"]
    assert compare.engine_frameworks("torch", "ddp") == ["ddp"]
    with pytest.raises(ValueError, match="--engines: 'nccl' is not one of horovod, ddp"):
        compare.engine_frameworks("torch", "nccl")
    with pytest.raises(ValueError, match="--engines ddp runs PyTorch: --frameworks must include torch"):
        compare.engine_frameworks("tf", "ddp")


def test_compare_refuses_a_bad_engine_before_any_run(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--engines", "mpi", "--out", "/nonexistent"])
    assert "--engines: 'mpi' is not one of horovod, ddp" in capsys.readouterr().err


def test_hooks_that_cannot_run_on_gloo_are_refused_saying_why():
    for name, why in torch_hooks.NOT_ON_GLOO.items():
        with pytest.raises(ValueError, match=re.escape(f"{name} does not run on Gloo: {why}")):
            compare.parse_compression(name)


def test_the_worker_refuses_a_hook_of_the_other_engine_before_starting_one():
    from scripts import compare_worker

    with pytest.raises(SystemExit, match="PyTorch's DDP hooks run with --framework ddp"):
        compare_worker.main(["--framework", "torch", "--workload", "mnist", "--compression", "torch-fp16"])
    with pytest.raises(SystemExit, match="hvd-fp16 is Horovod's; under DDP, torch-fp16"):
        compare_worker.main(["--framework", "ddp", "--workload", "mnist", "--compression", "hvd-fp16"])


def flat_run(framework, compression, rate, workers, samples_per_s, step_s, wire=None):
    row = {"workload": "resnet50", "framework": framework, "compression": compression, "rate": rate,
           "workers": workers, "status": "ok", "samples_per_s": samples_per_s, "step_s": step_s,
           "compute_s": step_s / 2, "compression_s": 0.0, "communication_s": step_s / 2,
           "bytes_per_step": 100, "epochs": [{"epoch": 1, "train_wall_s": 1.0}]}
    return row if wire is None else {**row, "wire_bytes_per_step": wire}


def test_ddp_rows_are_set_against_pytorchs_one_worker_alone():
    """One worker alone runs Horovod's own optimizer (PyTorch); DDP's rows share it: DDP at 160
    samples/s on 2 workers is 80 per worker, 0.80 of 100 alone."""
    rows = compare.medians([flat_run("torch", "fp32", compare.ALONE, 1, 100.0, 0.16),
                            flat_run("torch", "fp32", "1gbit", 2, 60.0, 0.5),
                            flat_run("ddp", "fp32", "1gbit", 2, 160.0, 0.2),
                            flat_run("ddp", "torch-fp16", "1gbit", 2, 180.0, 0.18)])
    assert compare.alone_limits(rows) == {("resnet50", "torch"): 100.0, ("resnet50", "ddp"): 100.0}
    table = compare.end_to_end_markdown(rows)
    assert "one worker alone (samples/s): PyTorch 100.0, PyTorch DDP 100.0." in table
    assert "| fp32 | 30.0 | 0.30 |" in table and "| 80.0 | 0.80 |" in table
    assert "| torch-fp16 |  |  |  |  |  |  | 90.0 | 0.90 |" in table  # no Horovod cells


def test_the_step_time_table_sets_each_engine_against_its_own_fp32():
    rows = compare.medians([flat_run("torch", "fp32", "1gbit", 2, 10.0, 0.2, wire=2048),
                            flat_run("torch", "hvd-fp16", "1gbit", 2, 20.0, 0.1, wire=1024),
                            flat_run("ddp", "fp32", "1gbit", 2, 20.0, 0.1, wire=2048),
                            flat_run("ddp", "torch-fp16", "1gbit", 2, 40.0, 0.05, wire=1024)])
    table = compare.step_time_markdown(rows)
    assert "| fp32 | 200 | 1.00 | 2 | 100 | 1.00 | 2 |" in table
    assert "| hvd-fp16 | 100 | 2.00 | 1 |  |  |  |" in table
    assert "| torch-fp16 |  |  |  | 50 | 2.00 | 1 |" in table  # DDP's own fp32, not Horovod's
    assert compare.summary_markdown(rows) == table


def test_momentum_goes_to_the_compressor_as_horovods_wrapper_would_take_it_over():
    """``--momentum-to compressor``: what a DDP user does by hand where Horovod takes SGD's momentum
    over: the compressor given it (signum as its beta), the optimizer none; random-k none at all;
    a momentum the user gave stays; compressors without a momentum of their own, and PyTorch's
    hooks, are left as they are (the optimizer keeps it)."""
    def to(spec):
        return quality.momentum_to_compressor(spec)
    assert to('{"compressor": "dgc"}') == ('{"compressor": "dgc", "momentum": 0.9}', 0.0)
    assert to('{"compressor": "signum"}') == ('{"compressor": "signum", "beta": 0.9}', 0.0)
    assert to('{"compressor": "onebit"}') == ('{"compressor": "onebit", "momentum": 0.9}', 0.0)
    assert to('{"compressor": "dgc", "momentum": 0.5}') == ('{"compressor": "dgc", "momentum": 0.5}', 0.0)
    assert to('{"compressor": "randomk"}') == ('{"compressor": "randomk"}', 0.0)
    assert to('{"compressor": "topk"}') == ('{"compressor": "topk", "momentum": 0.9}', 0.0)
    assert to('{"compressor": "topk", "memory": "residual"}') == (
        '{"compressor": "topk", "memory": "residual"}', None)
    for unchanged in ('{"compressor": "threshold"}', '{"compressor": "signsgd"}', "fp32", "torch-fp16"):
        assert to(unchanged) == (unchanged, None)
    # With Adam, the compressors that take beta_1 over are given it, and Adam has none.
    adam = quality.momentum_to_compressor
    assert adam('{"compressor": "dgc"}', "adam") == ('{"compressor": "dgc", "momentum": 0.9}', 0.0)
    assert adam('{"compressor": "signum"}', "adam") == ('{"compressor": "signum", "beta": 0.9}', 0.0)
    for unchanged in ('{"compressor": "onebit"}', '{"compressor": "randomk"}', '{"compressor": "topk"}'):
        assert adam(unchanged, "adam") == (unchanged, None)


def run(framework: str, compression: str, accuracy: float) -> dict:
    epochs = [{"epoch": 1, "test_accuracy": accuracy - 0.05, "train_wall_s": 1.0},
              {"epoch": 2, "test_accuracy": accuracy, "train_wall_s": 2.0}]
    return {"workload": "mnist", "optimizer": "sgd", "framework": framework, "compression": compression,
            "seed": 0, "status": "ok", "epochs": epochs, "bytes_per_step": 100, "step_s": 0.01}


def test_ddp_rows_are_judged_against_ddp_without_a_hook_beside_horovods_run():
    topk, dgc = '{"compressor": "topk"}', '{"compressor": "dgc"}'
    given = {**run("ddp", '{"compressor": "dgc", "momentum": 0.9}', 0.884), "optimizer_momentum": 0.0}
    plain = '{"compressor": "topk", "memory": "residual"}'  # what a hook's top-k computes over SGD
    results = [run("torch", "fp32", 0.885), run("torch", topk, 0.881), run("torch", dgc, 0.883),
               run("torch", plain, 0.880),
               run("ddp", "fp32", 0.886), run("ddp", "torch-powersgd-r1", 0.874),
               run("ddp", topk, 0.879), run("ddp", dgc, 0.100), given]
    rows = quality.summarize(results)
    gaps = {(r["framework"], r["compressor"], r.get("optimizer_momentum")): r["gap"] for r in rows}
    assert gaps[("ddp", "torch-powersgd-r1", None)] == pytest.approx(1.2)  # to DDP's 0.886
    assert gaps[("ddp", "topk", None)] == pytest.approx(0.7)
    assert gaps[("torch", "topk", None)] == pytest.approx(0.4)
    table = quality.markdown(rows)
    main, ddp = table.split("PyTorch DDP", 1)
    assert "torch-powersgd-r1" not in main  # the Horovod table keeps its two frameworks
    assert "| torch-powersgd-r1 | – | 0.8740 | +1.20 | ≤ 1 ✗ | – |" in ddp
    # beside Horovod's run of the same bits: top-k there takes SGD's momentum over, the hook cannot
    assert "| topk | – | 0.8790 | +0.70 | ≤ 1 ✓ | 0.8800 |" in ddp
    assert "| DDP, no hook (fp32) | – | 0.8860 | +0.00 |  | 0.8850 |" in ddp
    assert "| dgc | – | 0.1000 | +78.60 | ≤ 1 ✗ | 0.8830 |" in ddp
    # given by hand, set beside Horovod's dgc, whose wrapper takes the momentum over
    assert "| dgc(momentum=0.9), SGD's momentum 0 | – | 0.8840 | +0.20 | ≤ 1 ✓ | 0.8830 |" in ddp
    # two runs that differ only in where the momentum went are two set-ups
    apart = [run("ddp", dgc, 0.1), {**run("ddp", dgc, 0.1), "optimizer_momentum": 0.0}]
    assert len(quality.merge([apart])) == 2
