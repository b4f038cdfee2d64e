"""Property tests of the evaluation loaders with malformed files (issue 42; mjp_fast/evaluate/): CIFAR-10-C's
``.npy`` arrays (:func:`open_cifar10_c`) and the ImageNet-A, -R, -O (:func:`open_natural_sets`) and ImageNet-C
(:func:`open_imagenet_c`) folder trees, damaged at random: random bytes, truncated files and ``.npy`` headers, bytes
flipped in a header, arrays of another shape or dtype, empty files and folders, files where folders belong, images
that are not images (a format's magic bytes, then noise). Opening a set either works, and then every sample reads as
an image or fails as ``ConfigError``, or it fails once with a ``ValueError`` (``ConfigError`` is one) whose message,
one line, names the option and the damaged file or folder: never another exception type.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from PIL import Image

from mjp_fast.evaluate.cifar10_c import CIFAR10_CLASSES, open_cifar10_c
from mjp_fast.evaluate.imagenet_c import open_imagenet_c
from mjp_fast.evaluate.natural import NATURAL_SETS, imagenet_1k_wnids, open_natural_sets
from mjp_fast.train.config import ConfigError

# What the damaged files make NumPy and Pillow warn about on their way to the refusal.
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning",
    "ignore::UserWarning:PIL",
    "ignore::PIL.Image.DecompressionBombWarning",
)
WNIDS = imagenet_1k_wnids()[:3]  # real ImageNet-1k WordNet ids
MAGIC = (b"\xff\xd8\xff\xe0", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"BM", b"II*\x00", b"RIFF\x00\x00\x00\x00WEBP", b"P6\n")


def image_bytes(fmt: str, size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format=fmt)
    return buffer.getvalue()


@st.composite
def file_contents(draw: st.DrawFn, valid_share: int = 1) -> bytes:
    """What an image file of a tree holds: a valid tiny JPEG or PNG, or not one (empty, noise, a format's magic bytes
    then noise, a valid image cut short)."""
    kind = draw(st.sampled_from(("valid",) * valid_share + ("empty", "noise", "magic", "truncated")))
    if kind == "empty":
        return b""
    if kind == "noise":
        return draw(st.binary(min_size=1, max_size=200))
    if kind == "magic":
        return draw(st.sampled_from(MAGIC)) + draw(st.binary(max_size=200))
    size = (draw(st.integers(1, 8)), draw(st.integers(1, 8)))
    data = image_bytes(draw(st.sampled_from(("JPEG", "PNG"))), size, (draw(st.integers(0, 255)), 30, 200))
    if kind == "truncated":
        return data[: draw(st.integers(0, len(data) - 1))]
    return data


def note_outcome(outcome: str) -> None:
    """Counts an outcome (``--hypothesis-show-statistics``), inside a property test."""
    if currently_in_test_context():
        event(outcome)


def assert_names(error: BaseException, option: str, paths: list[Path]) -> None:
    """One ValueError (ConfigError is one), one line, naming ``option`` and one of ``paths``."""
    note_outcome(f"refused: {type(error).__name__}")
    assert isinstance(error, ValueError), f"{type(error).__name__}: {error}"
    message = str(error)
    assert "\n" not in message, message
    assert option in message, message
    assert any(str(path) in message for path in paths), f"names none of {[str(p) for p in paths]}: {message}"


def read_every_sample(dataset, root: Path) -> None:
    """Every sample of an opened set is an image with a target, or a ConfigError naming a file under ``root``."""
    for index in range(len(dataset)):
        try:
            image, target = dataset[index]
        except ConfigError as error:
            note_outcome("opened, a sample refused")
            assert "\n" not in str(error) and str(root) in str(error), str(error)
            continue
        note_outcome("opened, a sample read")
        assert isinstance(image, Image.Image) and image.mode == "RGB" and isinstance(target, int)


# ---- CIFAR-10-C


def write_cifar10_c(root: Path, per_severity: int, per_severity_labels: bool) -> None:
    """A valid CIFAR-10-C set of one corruption: fog.npy uint8 [5 x N, 32, 32, 3] and labels.npy."""
    root.mkdir()
    generator = np.random.default_rng(per_severity)
    np.save(root / "fog.npy", generator.integers(0, 256, (5 * per_severity, 32, 32, 3), dtype=np.uint8))
    labels = generator.integers(0, 10, per_severity if per_severity_labels else 5 * per_severity)
    np.save(root / "labels.npy", labels.astype(np.int64))


ZIP_MAGIC = b"PK\x03\x04"  # what np.load takes for an .npz archive
NPY_MAGIC = b"\x93NUMPY"
NPY_DTYPES = ("|u1", "|i1", "<i8", "<u8", ">i4", "<f4", "<f8", "|b1", "<c8", "<U3", "|V4", "|O", "<M8[s]")


HANDLED = ("noise", "truncated", "header shape", "array")  # damages open_cifar10_c refuses by name today
UNCAUGHT = ("magic noise", "header byte", "zip noise", "npz")  # and those that reach an exception _load lets out


@st.composite
def damages(draw: st.DrawFn, kinds: tuple[str, ...]) -> tuple[str, str, object]:
    """``(file, kind, what)``: which file of the set is damaged, and how."""
    target = draw(st.sampled_from(("fog.npy", "labels.npy")))
    kind = draw(st.sampled_from(kinds))
    if kind == "noise":  # neither a zip archive's start nor NumPy's: see the UNCAUGHT damages for those
        what = draw(st.binary(max_size=300).filter(lambda data: not data.startswith((ZIP_MAGIC, NPY_MAGIC[:1]))))
    elif kind == "magic noise":  # NumPy's magic string and a version, then anything
        what = NPY_MAGIC + draw(st.sampled_from((b"\x01\x00", b"\x02\x00", b"\x03\x00"))) + draw(st.binary())
    elif kind == "zip noise":  # a zip archive's start (what np.load takes for an .npz), then anything
        what = ZIP_MAGIC + draw(st.binary(max_size=300))
    elif kind == "npz":  # np.savez of the right array, under the .npy name
        what = None
    elif kind == "truncated":  # cut anywhere: in the magic string, the header's length or text, the data
        what = draw(st.floats(0.0, 1.0, exclude_max=True))
    elif kind == "header byte":  # one byte of the header (its length, its text) changed
        what = (draw(st.integers(6, 127)), draw(st.integers(0, 255)))
    elif kind == "header shape":  # a well-formed header that declares another shape for the same data
        what = draw(st.lists(st.integers(-3, 2**40), max_size=5).map(tuple))
    else:  # a valid .npy file of another array
        shape = tuple(draw(st.lists(st.integers(0, 6), max_size=5)))
        if draw(st.booleans()):  # the right layout, or near it
            count = 5 * draw(st.integers(0, 2)) + draw(st.sampled_from((0, 0, 1)))
            shape = (count, 32, 32, 3)[: draw(st.integers(1, 4))]
        what = (shape, draw(st.sampled_from(NPY_DTYPES)), draw(st.integers(-12, 300)))
    return target, kind, what


def damage(path: Path, kind: str, what: object) -> None:
    data = path.read_bytes()
    if kind in ("noise", "magic noise", "zip noise"):
        path.write_bytes(what)
    elif kind == "npz":
        array = np.load(path)
        with open(path, "wb") as file:
            np.savez(file, array)
    elif kind == "truncated":
        path.write_bytes(data[: int(len(data) * what)])
    elif kind == "header byte":
        position, value = what
        path.write_bytes(data[:position] + bytes([value]) + data[position + 1 :])
    elif kind == "header shape":
        array = np.load(path)
        with open(path, "wb") as file:
            header = {"descr": np.lib.format.dtype_to_descr(array.dtype), "fortran_order": False, "shape": what}
            np.lib.format.write_array_header_1_0(file, header)
            file.write(array.tobytes())
    else:
        shape, dtype, fill = what
        dtype = np.dtype(dtype)
        if dtype.kind == "O":
            array = np.full(shape, fill, dtype=object)
        elif dtype.kind in "UV":
            array = np.zeros(shape, dtype=dtype)
        else:
            array = np.full(shape, fill).astype(dtype)
        np.save(path, array, allow_pickle=True)


def open_damaged_cifar10_c(per_severity: int, per_severity_labels: bool, broken: tuple[str, str, object]) -> None:
    """A CIFAR-10-C set with one file damaged: opened, then it is a valid set (every severity's first and last
    sample read); or refused with one ValueError naming the option and that file."""
    target, kind, what = broken
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "c"
        write_cifar10_c(root, per_severity, per_severity_labels)
        damage(root / target, kind, what)
        try:
            sets = open_cifar10_c(root, list(CIFAR10_CLASSES))
        except Exception as error:  # noqa: BLE001 - the property: which exceptions come out
            assert_names(error, "--cifar10-c", [root / target])
            return
        note_outcome("opened")
        for makers in sets.sources.values():  # opened: the damage left a valid set
            for make in makers:
                dataset = make()
                for index in {0, len(dataset) - 1}:
                    image, label = dataset[index]
                    assert image.size == (32, 32) and 0 <= label < 10


@given(st.integers(1, 2), st.booleans(), damages(HANDLED))
def test_a_damaged_cifar10_c_file_is_one_value_error_naming_it(per_severity, per_severity_labels, broken):
    open_damaged_cifar10_c(per_severity, per_severity_labels, broken)


@given(st.integers(1, 2), st.booleans(), damages(UNCAUGHT))
@example(1, False, ("fog.npy", "header byte", (8, 1)))  # tokenize.TokenError: EOF in multi-line statement
@example(1, False, ("labels.npy", "zip noise", b""))  # zipfile.BadZipFile: File is not a zip file
@example(1, True, ("labels.npy", "npz", None))  # AttributeError: 'NpzFile' object has no attribute 'ndim'
def test_a_cifar10_c_file_with_a_broken_header_or_in_zip_format_is_one_value_error_naming_it(
    per_severity, per_severity_labels, broken
):
    open_damaged_cifar10_c(per_severity, per_severity_labels, broken)


# ---- ImageNet-A, -R, -O


FOLDER_NAMES = (*WNIDS, "n99999999", "tench", ".hidden", "0.jpg")
FILE_NAMES = ("0.jpg", "1.JPEG", "2.png", "3.txt", "README.txt", "4.webp")


@st.composite
def trees(draw: st.DrawFn, names: tuple[str, ...] = FOLDER_NAMES) -> dict:
    """``{name: None (an empty folder) | bytes (a file) | {file name: bytes}}``, or None (no tree at all) or bytes
    (a file where the tree belongs)."""
    kind = draw(st.sampled_from(("tree", "tree", "tree", "missing", "file")))
    if kind == "missing":
        return None
    if kind == "file":
        return draw(st.binary(max_size=64))
    entries = {}
    for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
        entry = draw(st.sampled_from(("folder", "folder", "folder", "empty folder", "file")))
        if entry == "empty folder":
            entries[name] = None
        elif entry == "file":
            entries[name] = draw(st.binary(max_size=64))
        else:
            files = draw(st.lists(st.sampled_from(FILE_NAMES), min_size=1, max_size=3, unique=True))
            entries[name] = {file: draw(file_contents(valid_share=3)) for file in files}
    return entries


def write_tree(root: Path, tree: dict | bytes | None) -> None:
    if tree is None:
        return
    if isinstance(tree, bytes):
        root.write_bytes(tree)
        return
    root.mkdir(parents=True)
    for name, entry in tree.items():
        if entry is None:
            (root / name).mkdir()
        elif isinstance(entry, bytes):
            (root / name).write_bytes(entry)
        else:
            write_tree(root / name, entry)


class _ValLoader:
    """What the sets read of the validation loader: its dataset (a stream: no targets, no transform)."""

    dataset: list = []


@given(st.sampled_from(sorted(NATURAL_SETS)), trees())
def test_a_malformed_natural_set_tree_is_one_value_error_naming_it(key, tree):
    option = NATURAL_SETS[key].option
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "release"
        write_tree(root, tree)
        try:
            (natural,) = open_natural_sets(
                {key: root}, classes=None, num_classes=1000, val_loader=_ValLoader(), make_loader=lambda data: data
            )
        except Exception as error:  # noqa: BLE001 - the property: which exceptions come out
            assert_names(error, option, [root])
            return
        read_every_sample(natural.loader, root)


# ---- ImageNet-C


@st.composite
def imagenet_c_trees(draw: st.DrawFn) -> dict | bytes | None:
    """A tree of anything, or ImageNet-C's layout (``fog/<severity 1-5>/<wnid>/*``, under its family folder or not)
    with up to three damages: a severity left out, made a file or empty; a folder not named by a WordNet id; an
    empty class folder; a file beside the class folders; images that are not images."""
    if draw(st.integers(0, 3)) == 0:
        return draw(trees(names=("fog", "weather", "gaussian_noise", "1", "x")))
    severities = {}
    for severity in range(1, 6):
        wnids = WNIDS[: draw(st.integers(1, 3))]
        severities[str(severity)] = {wnid: {"0.JPEG": draw(file_contents(valid_share=6))} for wnid in wnids}
    for _ in range(draw(st.integers(0, 3))):
        severity = draw(st.sampled_from(sorted(severities)))
        change = draw(st.sampled_from(("drop", "file", "empty", "tench", "empty class", "beside", "extra severity")))
        if change == "drop":
            severities.pop(severity)
        elif change == "file":
            severities[severity] = draw(st.binary(max_size=16))
        elif change == "empty":
            severities[severity] = {}
        elif isinstance(severities[severity], dict):
            classes = severities[severity]
            if change == "tench":
                classes["tench"] = {"0.JPEG": draw(file_contents())}
            elif change == "empty class":
                classes[draw(st.sampled_from(WNIDS))] = {}
            elif change == "beside":
                classes["README.txt"] = draw(st.binary(max_size=16))
            else:
                severities["6"] = {WNIDS[0]: {"0.JPEG": draw(file_contents())}}
        if not severities:
            break
    return {"weather": {"fog": severities}} if draw(st.booleans()) else {"fog": severities}


@given(imagenet_c_trees(), st.integers(0, 3))
def test_a_malformed_imagenet_c_tree_is_one_value_error_naming_it(tree, max_bad):
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "imagenet-c"
        write_tree(root, tree)
        try:
            sets = open_imagenet_c(root, list(WNIDS), max_bad=max_bad)
        except Exception as error:  # noqa: BLE001 - the property: which exceptions come out
            assert_names(error, "--imagenet-c", [root])
            return
        for makers in sets.sources.values():
            for make in makers:
                try:
                    dataset = make()  # a severity's images, listed when its pass comes
                except Exception as error:  # noqa: BLE001
                    assert isinstance(error, ConfigError), f"{type(error).__name__}: {error}"
                    assert_names(error, "--imagenet-c", [root])
                    continue
                read_every_sample(dataset, root)


def test_the_trees_hold_what_the_loaders_read():
    """The strategies make valid images too: a tree of them opens, and every sample reads (so the properties above
    see both outcomes)."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "imagenet-c"
        valid = image_bytes("JPEG", (4, 4), (10, 20, 30))
        write_tree(root, {"fog": {str(s): {wnid: {"0.JPEG": valid} for wnid in WNIDS} for s in range(1, 6)}})
        sets = open_imagenet_c(root, list(WNIDS))
        for make in sets.sources["fog"]:
            read_every_sample(make(), root)
        assert len(sets.sources["fog"][0]()) == len(WNIDS)
    with pytest.raises(ValueError, match="--imagenet-c"):
        open_imagenet_c(Path(folder), list(WNIDS))
