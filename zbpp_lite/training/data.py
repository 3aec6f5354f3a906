"""The jobs' data sets, offline: scikit-learn's bundled handwritten digits as sequences of 8 row tokens,
batched as the PyTorch benchmark (``shared/peers/torch_pp_bench.py``) batches them; and, for the GPT,
the bytes of this Python's own standard library source (:func:`load_text`). :func:`load_data` picks
the model's.

1,797 images, each 8 row tokens of 8 pixels / 16 (float32 in [0, 1]); labels int32 in 0..9. Step k
uses ``perm[(k * batch + arange(batch)) % n]``, ``perm = np.random.default_rng(seed).permutation(n)``.
``holdout`` > 0 (ours): the test set is the last ``round(holdout * 1797)`` of
``default_rng(seed + 1).permutation(1797)``, training the rest in order; ``holdout=0``: the PyTorch
script's batches, tested on all samples.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import sysconfig
from dataclasses import dataclass

import numpy as np

from .model import GPTConfig, ModelConfig, RunConfig

NUM_SAMPLES = 1797


def _digits_file() -> pathlib.Path | None:
    """scikit-learn's ``datasets/data/digits.csv.gz``, located without importing it; None if not found."""
    spec = importlib.util.find_spec("sklearn")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def load_digit_tokens() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits: ``x`` (1797, 8, 8) float32 in [0, 1] (rows as tokens), ``y`` (1797,) int32.

    Read from the file scikit-learn's ``load_digits`` reads (``sklearn/datasets/data/digits.csv.gz``: 64
    pixels 0-16 and the label a row), found without importing scikit-learn: its import costs about 1.5 s
    of CPU in every process that loads the digits (each rank process, each command). Where the file is
    not there, ``sklearn.datasets.load_digits`` itself (tests/test_model.py checks both agree)."""
    path = _digits_file()
    if path is not None:
        table = np.loadtxt(path, delimiter=",")
        pixels, labels = table[:, :64], table[:, 64]
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        pixels, labels = digits.data, digits.target
    return (pixels.reshape(-1, 8, 8) / 16.0).astype(np.float32), labels.astype(np.int32)


def batch_indices(n: int, batch: int, step: int, seed: int) -> np.ndarray:
    """Sample indices of training step ``step``: ``perm[(step * batch + arange(batch)) % n]``."""
    perm = np.random.default_rng(seed).permutation(n)
    return perm[(step * batch + np.arange(batch)) % n]


@dataclass(frozen=True)
class Digits:
    """Training samples ``train_x`` (n, 8, 8) float32, ``train_y`` (n,) int32; ``test_x``, ``test_y``
    held out (all samples when ``holdout`` is 0); ``seed`` of the batch order (+1: of the split)."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    holdout: float
    seed: int

    def batch(self, step: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The global batch of training step ``step``: inputs (b, 8, 8) and labels (b,)."""
        idx = batch_indices(len(self.train_y), batch_size, step, self.seed)
        return self.train_x[idx], self.train_y[idx]


def load_digits(holdout: float = 0.0, seed: int = 0) -> Digits:
    """The digits with ``holdout`` of them held out for testing (see the module docstring).

    Raises:
        ValueError: ``holdout`` outside [0, 1) or one that leaves no test or no training sample.
    """
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    x, y = load_digit_tokens()
    n_test = round(holdout * NUM_SAMPLES)
    if holdout > 0 and not 0 < n_test < NUM_SAMPLES:
        raise ValueError(f"holdout {holdout} leaves {n_test} test samples of {NUM_SAMPLES}; "
                         "choose a larger or smaller fraction")
    if n_test == 0:
        return Digits(x, y, x, y, holdout, seed)
    test = np.sort(np.random.default_rng(seed + 1).permutation(NUM_SAMPLES)[NUM_SAMPLES - n_test :])
    train = np.setdiff1d(np.arange(NUM_SAMPLES), test)
    return Digits(x[train], y[train], x[test], y[test], holdout, seed)


# ----------------------------------------------------------------------------- text: bytes of Python


@functools.lru_cache(maxsize=1)
def stdlib_files(root: str | None = None) -> tuple[tuple[str, bytes], ...]:
    """``(relative path, bytes)`` of every ``.py`` file under the standard library
    (``sysconfig.get_paths()["stdlib"]``, or ``root``), sorted by path, leaving out ``site-packages``
    and the test suites (folders named ``test`` or ``tests``): 799 files, 12.6 MB on CPython 3.11.7.

    Raises:
        ValueError: no such file there (a Python without its source).
    """
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests"}
    paths = sorted(p for p in base.rglob("*.py") if not skip & set(p.relative_to(base).parts[:-1]))
    if not paths:
        raise ValueError(f"no .py files under {base}: the byte corpus needs Python's standard library source")
    return tuple((p.relative_to(base).as_posix(), p.read_bytes()) for p in paths)


@dataclass(frozen=True)
class ByteText:
    """Bytes of Python source split by file, as next-byte prediction.

    Attributes:
        train_bytes: the training files' bytes, concatenated in path order, uint8.
        test_x, test_y: validation windows (n, context) int32, ``test_y`` the next byte of each position;
            ``n`` windows evenly spaced over the validation files' bytes (fixed: every run sees the same).
        train_files, test_files: relative paths. context: tokens per window. holdout, seed: as
            :func:`load_text`.
    """

    train_bytes: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    context: int
    holdout: float
    seed: int

    def batch(self, step: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Step ``step``'s windows: ``x`` (b, context) int32 at starts drawn by
        ``default_rng((seed, step))`` over the training bytes, ``y`` the next byte of each position."""
        starts = np.random.default_rng((self.seed, step)).integers(0, len(self.train_bytes) - self.context,
                                                                   batch_size)
        return _windows(self.train_bytes, starts, self.context)

    def unigram_nats(self) -> float:
        """Entropy of the validation targets' byte frequencies, nats per byte: the loss of the best
        model that ignores context (the unigram baseline; the loss is a mean cross-entropy in nats)."""
        freq = np.bincount(self.test_y.ravel(), minlength=256) / self.test_y.size
        freq = freq[freq > 0]
        return float(-(freq * np.log(freq)).sum())


def _windows(data: np.ndarray, starts: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    idx = starts[:, None] + np.arange(context + 1)
    seq = data[idx].astype(np.int32)
    return seq[:, :-1], seq[:, 1:]


def load_text(context: int, holdout: float = 0.2, seed: int = 0, windows: int = 256,
              root: str | None = None) -> ByteText:
    """The byte corpus (:func:`stdlib_files`) split by file: the last ``round(holdout * files)`` of
    ``default_rng(seed + 1).permutation(files)`` validate, the rest train; ``windows`` validation
    windows of ``context`` bytes. Same Python, same arguments: same split, batches and windows.

    Raises:
        ValueError: ``holdout`` outside (0, 1), or a split or corpus too small for one window.
    """
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout must be in (0, 1) for the text (files held out for validation), "
                         f"got {holdout}")
    files = stdlib_files(root)
    n_test = round(holdout * len(files))
    test = set(np.random.default_rng(seed + 1).permutation(len(files))[len(files) - n_test:].tolist())
    parts = [[f for i, f in enumerate(files) if (i in test) == held] for held in (False, True)]
    train, valid = (np.frombuffer(b"".join(data for _, data in part), np.uint8) for part in parts)
    if min(len(train), len(valid)) <= context or not 0 < n_test < len(files):
        raise ValueError(f"holdout {holdout} of {len(files)} files leaves {len(train)} training and "
                         f"{len(valid)} validation bytes: too few for a window of {context}")
    starts = np.linspace(0, len(valid) - context - 1, windows).astype(np.int64)
    x, y = _windows(valid, starts, context)
    return ByteText(train, x, y, tuple(n for n, _ in parts[0]), tuple(n for n, _ in parts[1]), context,
                    holdout, seed)


def data_json(data: Digits | ByteText) -> dict:
    """What a run's settings record of its data: for the text, the files on each side and the unigram
    baseline in nats per byte (:meth:`ByteText.unigram_nats`); nothing for the digits."""
    if not isinstance(data, ByteText):
        return {}
    return {"train_files": len(data.train_files), "validation_files": len(data.test_files),
            "unigram_nats": data.unigram_nats()}


def sample_shapes(config: ModelConfig, n: int) -> tuple[tuple[tuple, np.dtype], tuple[tuple, np.dtype]]:
    """``((shape, dtype) of x, (shape, dtype) of y)`` of ``n`` samples of ``config``'s data, without
    reading it: digits (n, 8, 8) float32 and (n,) int32; text (n, context) int32 twice."""
    if isinstance(config, GPTConfig):
        return ((n, config.context), np.dtype(np.int32)), ((n, config.context), np.dtype(np.int32))
    return ((n, 8, 8), np.dtype(np.float32)), ((n,), np.dtype(np.int32))


def load_data(config: ModelConfig, run: RunConfig) -> Digits | ByteText:
    """The data of ``config``'s model: :func:`load_text` for a :class:`~.model.GPTConfig` (its context),
    else :func:`load_digits`; ``run.holdout`` held out, ``run.seed`` orders the batches."""
    if isinstance(config, GPTConfig):
        return load_text(config.context, run.holdout, run.seed)
    return load_digits(run.holdout, run.seed)
