"""The GPT (training.model.GPTConfig) through the pipeline: at step 0 the pipeline's loss and gradients
equal the unpartitioned model's (jax.grad of the same masked model, tied embedding one parameter), with
dropout on and, in float32, every block under jax.checkpoint; its data split by file, reproducibly; a
GPT-2-small shape builds and plans from shapes alone. Tiny sizes: each compiles in seconds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zbpp_lite as zb
from zbpp_lite.runtime.executor import PipelineExecutor
from zbpp_lite.runtime.stages import StagedModel, dropout_keys
from zbpp_lite.training.data import ByteText, load_data, load_text, stdlib_files
from zbpp_lite.training.model import GPTConfig, RunConfig, abstract_parts, build_parts, config_json, config_of
from zbpp_lite.training.reference import GRAD_CHECK_TOLERANCE, max_relative_error, write_bytes
from zbpp_lite.training.train import TrainOptions, job_plan, train

DEVICES = jax.devices()
TINY = GPTConfig(d=16, heads=2, blocks=2, context=16, dropout=0.2, remat=True)
M, MB = 4, 2  # microbatches, sequences per microbatch


def test_step_0_equals_the_unpartitioned_model_with_tied_embedding_dropout_and_remat():
    """zb-h1 (B and W apart) on 2 ranks: loss within 1e-5 of model.loss with the same keys, every
    gradient within the digits runs' tolerance (in fact ~1e-6); each copy of the tied embedding gets the
    tied parameter's whole gradient; the masks are on (without the keys the loss is another)."""
    model = StagedModel(build_parts(TINY), 2)
    (tie,) = model.ties  # the token embedding, in part 0 and in the head
    assert [part for part, _, _ in tie.copies] == [0, TINY.blocks + 1]
    assert model.random_parts == (0, 1, 2)  # the embedding's dropout and each block's
    data = load_text(TINY.context, 0.2, seed=3)
    x, y = data.batch(0, M * MB)
    keys = dropout_keys(3, 0, M)
    result = PipelineExecutor(model, zb.build_schedule("zb-h1", 2, M), DEVICES[:2]).run(model.params, x, y, keys)
    ref_loss, ref = jax.value_and_grad(model.loss)(model.params, x, y, keys)
    assert abs(result.loss - float(ref_loss)) <= 1e-5
    assert max_relative_error(result.grads, ref) <= min(GRAD_CHECK_TOLERANCE, 1e-4)
    copies = [np.asarray(jax.tree_util.tree_leaves(result.grads[part])[leaf]) for part, leaf, _ in tie.copies]
    assert np.array_equal(copies[0], copies[1])
    assert abs(float(model.loss(model.params, x, y)) - float(ref_loss)) > 1e-3


def test_train_runs_the_gpt_with_its_data_keys_and_check():
    """train() (the loop every command uses): the text batches, step k's dropout keys, the step-0 check
    against the unpartitioned model with the same keys, validation on held-out files (every eval_every
    steps: the curve the report draws, its last point the test loss), the unigram baseline recorded
    beside the settings; what the model writes repeats under one seed; the page holds the curve."""
    from zbpp_lite.cli.compare_report import run_page
    from zbpp_lite.cli.train import curve_line, written_lines
    from zbpp_lite.training.reference import evaluate

    config = GPTConfig(d=16, heads=2, blocks=2, context=16, dropout=0.2)
    result = train("zb-h1", 2, 2, steps=3, model=config, run=RunConfig(batch=4, lr=3e-3, eval_every=2),
                   options=TrainOptions(devices=DEVICES[:2]))
    assert result.grad_max_rel_error <= 1e-5 and result.loss_error <= 1e-5 * result.losses[0]
    assert result.config["model"] == "gpt" and result.config["context"] == 16
    data = load_text(16, 0.2, 0)
    assert result.config["unigram_nats"] == pytest.approx(data.unigram_nats())
    assert 0 < result.test_loss < np.log(256) + 1 and 0 <= result.test_accuracy <= 1
    assert [k for k, _ in result.validation] == [0, 2, 3] and result.validation[-1][1] == result.test_loss
    initial = StagedModel(build_parts(config), 1)
    assert result.validation[0][1] == pytest.approx(evaluate(initial, initial.params, data.test_x, data.test_y)[0])
    assert result.to_json()["validation"][1]["step"] == 2
    assert curve_line(result).startswith("validation loss after 0, 2, 3 steps: ")
    written = written_lines(result, config, seed=5)
    assert all(c.isprintable() or c in "\n\t" for c in written)  # no terminal escapes from 3 steps' model
    assert written == written_lines(result, config, seed=5) != written_lines(result, config, seed=6)
    assert written.startswith("what the model writes after 'def ' (temperature 0.8, seed 5):\ndef ")
    page = run_page(result, "the report", written)
    assert "validation loss (held-out files, no dropout)" in page and "unigram baseline" in page
    assert "temperature 0.8, seed 5" in page


def test_bf16_computes_in_bf16_and_keeps_float32_parameters_and_gradients():
    """dtype bfloat16: activations bf16, logits float32, parameters and the pipeline's gradients float32;
    the loss close to float32's (bf16 rounding, not a different model)."""
    config = GPTConfig(d=16, heads=2, blocks=2, context=16, dropout=0.0, dtype="bfloat16")
    model = StagedModel(build_parts(config), 2)
    x = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % 256
    hidden = model.apply_part(0, model.params[0], x)
    assert hidden.dtype == jnp.bfloat16 and model.logits(model.params, x).dtype == jnp.float32
    assert {a.dtype for a in jax.tree_util.tree_leaves(model.params)} == {jnp.dtype(jnp.float32)}
    result = PipelineExecutor(model, zb.build_schedule("1f1b", 2, 2), DEVICES[:2]).run(model.params, x, x)
    assert {g.dtype for g in jax.tree_util.tree_leaves(result.grads)} == {jnp.dtype(jnp.float32)}
    exact = StagedModel(build_parts(GPTConfig(d=16, heads=2, blocks=2, context=16, dropout=0.0)), 2)
    assert result.loss == pytest.approx(float(exact.loss(exact.params, x, x)), rel=2e-2)


def test_train_with_bf16_passes_its_gradient_check_within_bfloat16_rounding(capsys):
    """``train --model gpt --bf16``: the pipeline's microbatch sums and the whole batch's differ by bfloat16
    rounding (5.6e-3 here), which the check allows (4 epsilons, 0.03125); at float32's 1e-3 this run
    failed, exit 1, "this run's gradients are wrong". A wrong gradient is still far above it."""
    from zbpp_lite.cli import main
    from zbpp_lite.training.reference import grad_check_failure, grad_check_tolerance

    tolerance = grad_check_tolerance("bfloat16")
    assert tolerance == 4 * 2.0 ** -7 and grad_check_tolerance("float32") == GRAD_CHECK_TOLERANCE
    assert main(["train", "--model", "gpt", "--bf16", "--steps", "1", "--threads", "--d", "16", "--context", "16",
                 "--blocks", "2", "--heads", "2", "--microbatches", "8", "--batch", "16", "--no-progress"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("gradient check"))
    error = float(line.split("max relative error ")[1].split(",")[0])
    assert GRAD_CHECK_TOLERANCE < error < tolerance and "(tolerance 0.03125, relative)" in line
    assert grad_check_failure(0.25, 0.0, 1.0, tolerance)  # a microbatch of four lost still fails


def test_the_bytes_split_by_file_reproducibly():
    files = stdlib_files()
    assert [name for name, _ in files] == sorted(name for name, _ in files)
    a, b, other = load_text(32, 0.2, seed=0), load_text(32, 0.2, seed=0), load_text(32, 0.2, seed=1)
    assert not set(a.train_files) & set(a.test_files)
    assert sorted(a.train_files + a.test_files) == [name for name, _ in files]
    assert len(a.test_files) == round(0.2 * len(files))
    by_name = dict(files)
    assert a.train_bytes.tobytes() == b"".join(by_name[n] for n in a.train_files)  # whole files, in order
    assert a.test_files == b.test_files and a.test_files != other.test_files
    for k in (0, 7):
        assert all(np.array_equal(u, v) for u, v in zip(a.batch(k, 8), b.batch(k, 8)))
    x, y = a.batch(0, 8)
    assert x.shape == y.shape == (8, 32) and x.dtype == np.int32
    assert np.array_equal(x[:, 1:], y[:, :-1])  # y: the next byte of each position
    assert not np.array_equal(a.batch(0, 8)[0], a.batch(1, 8)[0])
    assert np.array_equal(a.test_x, b.test_x) and a.test_x.shape == (256, 32)
    # the unigram baseline: the entropy (nats) of the validation targets' byte frequencies
    freq = np.bincount(a.test_y.ravel(), minlength=256) / a.test_y.size
    assert a.unigram_nats() == pytest.approx(-sum(f * np.log(f) for f in freq if f > 0))
    assert 2.0 < a.unigram_nats() < np.log(256)
    assert isinstance(load_data(TINY, RunConfig(holdout=0.2)), ByteText)
    with pytest.raises(ValueError, match=r"^holdout must be in \(0, 1\) for the text"):
        load_text(32, 0.0)


def test_gpt2_small_builds_and_plans_from_shapes():
    """12 layers, d 768, 12 heads, context 1024: parameters as shapes only (nnx.eval_shape), the tie
    found, and zb-v planned with M_B, M_W from shapes (nothing the size of the model is allocated)."""
    big = GPTConfig(d=768, heads=12, blocks=12, context=1024)
    model = StagedModel(abstract_parts(big), 4)
    leaves = jax.tree_util.tree_leaves(model.params)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in leaves)
    # 12 (12 d^2 + 13 d) in the blocks + 256 d bytes + 1024 d positions + 2 d final LayerNorm: 86.0M, the
    # tied 256 d held by two parts
    unique = sum(int(np.prod(a.shape)) for a in leaves) - 256 * 768
    assert unique == 12 * (12 * 768**2 + 13 * 768) + 1282 * 768 == 86_039_040
    assert len(model.ties) == 1
    schedule, costs = job_plan("zb-v", 2, 4, {}, big, RunConfig(batch=4))
    assert schedule.num_stages == 4 and min(costs.mem_b) > 4 * 1024 * 768 * 4  # > 4 activations of a block
    assert config_of(config_json(big)) == big and config_of({"d": 8, "heads": 2, "blocks": 1}).d == 8


def test_the_model_writes_bytes_reproducibly_from_a_seed():
    config = GPTConfig(d=16, heads=2, blocks=2, context=16, dropout=0.2)
    model = StagedModel(build_parts(config), 1)
    a, b = (write_bytes(model, model.params, b"def ", 8, config.context, seed=1) for _ in range(2))
    assert len(a) == 8 and a == b and write_bytes(model, model.params, b"def ", 8, config.context, seed=2) != a
    with pytest.raises(ValueError, match="write_bytes needs a prompt"):
        write_bytes(model, model.params, b"", 8, config.context)


def test_the_whole_batch_baseline_trains_the_tied_gpt_with_dropout():
    """train_baseline (compare's one-device reference) donates its parameters: the tied copies get a buffer
    each, get the same gradient and stay equal; the loss falls."""
    from zbpp_lite.training.reference import train_baseline

    config = GPTConfig(d=16, heads=2, blocks=2, context=16)
    result = train_baseline(3, model=config, run=RunConfig(batch=8, lr=3e-3), microbatches=2)
    copies = [np.asarray(jax.tree_util.tree_leaves(result.params[part])[leaf]) for part, leaf in ((0, 1), (-1, 2))]
    assert copies[0].shape == (256, 16) and np.array_equal(*copies)
    assert result.losses[-1] < result.losses[0]


def test_the_gpt_has_its_own_command_line_defaults():
    """--model gpt: batch 16, lr 3e-3 (what bench_gpt_learns measured learning), 1500 steps, the validation
    loss every tenth of the steps (compare: of its learning run, none without one); the digits keep theirs;
    compare keeps its digits batch of 256, gives the GPT 16 and a 600-step learning run; a flag given wins;
    --eval-every is the GPT's."""
    from zbpp_lite.cli import CliError, parse_args
    from zbpp_lite.cli.compare import check_arguments
    from zbpp_lite.cli.train import check_model_arguments

    def filled(argv, check=lambda a: check_model_arguments(a, a.microbatches)):
        args = parse_args(argv)
        check(args)
        return args.batch, args.lr, args.steps, getattr(args, "eval_every", None)

    assert filled(["train", "--model", "gpt"]) == (16, 3e-3, 1500, 150)
    assert filled(["train"]) == (64, 1e-3, 30, None)
    assert filled(["train", "--model", "gpt", "--batch", "8", "--steps", "40"]) == (8, 3e-3, 40, 4)
    assert filled(["compare", "--model", "gpt", "--learn-steps", "0"], check_arguments)[3] == 0
    assert filled(["compare", "--model", "gpt"], check_arguments)[:2] == (16, 3e-3)
    assert parse_args(["compare", "--model", "gpt"]).learn_steps is None
    args = parse_args(["compare", "--model", "gpt"])
    check_arguments(args)
    assert args.learn_steps == 600 and args.eval_every == 60
    assert filled(["compare"], check_arguments)[:2] == (256, 1e-3)
    with pytest.raises(CliError, match="--eval-every"):
        filled(["train", "--eval-every", "5"])
