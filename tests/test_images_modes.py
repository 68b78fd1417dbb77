"""Every image file that can be decoded is read, as a photo viewer shows it; only the others are skipped and named.

One folder written with PIL holds the awkward cases a real photo folder has: every size from 40 to 72 px
(49 px to 32 once failed as "box offset can't be negative"), 1x1 and 2x3000, every PIL mode a file opens in
(L, LA, P with transparency, RGBA, CMYK, 1-bit, 16-bit gray, an RGB colour key), JPEG (.jpg, .jpeg, .jpe, .jfif), PNG, WebP
and BMP under lower- and upper-case extensions, the eight EXIF orientations, and four files that cannot be decoded (a
truncated JPEG, a truncated PNG, text named .png, an empty .JPG). Each readable image is four coloured
quadrants (or one colour), so orientation and colour are checked on the decoded pixels. The cache is built
once for the module (the real `image_folder` with its forked PIL workers); the CLI run reuses it.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from PIL import Image

from mpsrun.plugins.builtin.images import cache as cache_mod
from mpsrun.plugins.builtin.images import decode, gpu_decode, scan
from mpsrun.plugins.builtin.images.datasets import image_folder

from .conftest import RECIPES

SIZE = 32
GRAY_SIZE = [24, 40]  # a wide target: the crop and the JPEG draft must follow the rotation
RED, GREEN, BLUE, YELLOW, WHITE, BLACK = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (255, 255, 255), (0, 0, 0)
QUAD = (RED, GREEN, BLUE, YELLOW)  # top-left, top-right, bottom-left, bottom-right as a viewer shows the image
TOL = 30  # mean of a patch, per channel: JPEG and WebP blur colours a little, a wrong orientation or colour is off by 255
# what a viewer does to show orientation o, undone: the stored pixels are the upright image put through this
STORED = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
          5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_270}
ORIENTATION = 0x0112  # the EXIF tag
CORRUPT = ("zz_truncated.jpg", "zz_truncated.png", "zz_text.png", "zz_empty.JPG")


def _quad(w: int, h: int, colours=QUAD, dtype=np.uint8) -> np.ndarray:  # type: ignore[no-untyped-def]
    a = np.zeros((h, w, len(colours[0])), dtype)
    a[: h // 2, : w // 2], a[: h // 2, w // 2 :], a[h // 2 :, : w // 2], a[h // 2 :, w // 2 :] = colours
    return a[..., 0] if a.shape[-1] == 1 else a


def _png16(path: Path, gray: np.ndarray) -> None:
    """A 16-bit grayscale PNG written by hand (chunks, zlib), so the file is what a scanner or a camera's RAW export writes."""
    h, w = gray.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\0" + gray[y].astype(">u2").tobytes() for y in range(h))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def _write_zoo(root: Path) -> dict[str, tuple]:
    """Write the folder; returns {relative path: expected quadrant colours (4 RGB triples)} for every readable file."""
    expect: dict[str, tuple] = {}
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()

    def save(rel: str, im: Image.Image, colours: tuple = QUAD, **kw) -> None:  # type: ignore[no-untyped-def]
        im.save(root / rel, **kw)
        expect[rel] = colours

    upright = Image.fromarray(_quad(56, 40))
    for o in range(1, 9):  # the eight EXIF orientations, stored as a camera does
        exif = Image.Exif()
        exif[ORIENTATION] = o
        stored = upright.transpose(STORED[o]) if o > 1 else upright
        save(f"a/orient{o}.jpg", stored, exif=exif.tobytes(), quality=95)
        if o in (3, 6, 8):
            save(f"b/orient{o}.png", stored, exif=exif.tobytes())
            save(f"b/orient{o}.webp", stored, exif=exif.tobytes(), lossless=True)
    # an EXIF block cut short (an editor's bug): the pixels are fine and shown as stored; nvJPEG's path hands it to PIL
    save("a/orient_broken_exif.jpg", upright, exif=b"Exif\0\0MM\0*\0\0\0\x08\0\x05\x01\x12", quality=95)
    big = Image.fromarray(_quad(1600, 1200))  # large enough for the JPEG draft to scale by 1/8 in the DCT
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    save("a/big_orient6.jpg", big.transpose(STORED[6]), exif=exif.tobytes(), quality=90)
    save("a/big.JPEG", big, quality=90)
    for k, w in enumerate(range(40, 73)):  # every side from 40 to 72 px; 49 x 49 among them
        h = 40 + (w * 7) % 33
        save(f"{'ab'[k % 2]}/size{w}x{h}.{'jpg' if k % 2 else 'png'}", Image.fromarray(_quad(w, h)), quality=95)
    save("a/size49x49.jpg", Image.fromarray(_quad(49, 49)), quality=95)
    save("b/size49x49.png", Image.fromarray(_quad(49, 49)))
    save("a/one_pixel.png", Image.new("RGB", (1, 1), RED), (RED,) * 4)
    save("a/one_pixel.jpg", Image.new("RGB", (1, 1), GREEN), (GREEN,) * 4, quality=95)
    save("b/tall_2x3000.png", Image.new("RGB", (2, 3000), BLUE), (BLUE,) * 4)
    save("b/wide_3000x2.jpg", Image.new("RGB", (3000, 2), YELLOW), (YELLOW,) * 4, quality=95)
    # modes
    grays = ((0,), (85,), (170,), (255,))
    save("a/mode_L.png", Image.fromarray(_quad(56, 40, grays), "L"), tuple(g * 3 for g in grays))
    save("b/mode_L.jpg", Image.fromarray(_quad(56, 40, grays), "L"), tuple(g * 3 for g in grays), quality=95)
    la = _quad(56, 40, ((0, 255), (0, 0), (128, 255), (200, 0)))  # transparent is put on white
    save("a/mode_LA.png", Image.fromarray(la, "LA"), (BLACK, WHITE, (128,) * 3, WHITE))
    pal = Image.fromarray(_quad(56, 40, ((0,), (1,), (2,), (3,))), "P")
    pal.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0])
    save("b/mode_P.png", pal, (RED, GREEN, BLUE, BLACK))
    save("b/mode_P_transparent.png", pal, (RED, GREEN, BLUE, WHITE), transparency=3)
    save("a/mode_P.bmp", pal, (RED, GREEN, BLUE, BLACK))
    rgba = _quad(56, 40, ((255, 0, 0, 255), (0, 255, 0, 128), (0, 0, 255, 255), (0, 0, 0, 0)))
    save("a/mode_RGBA.png", Image.fromarray(rgba, "RGBA"), (RED, (127, 255, 127), BLUE, WHITE))
    save("b/mode_RGBA.webp", Image.fromarray(rgba, "RGBA"), (RED, (127, 255, 127), BLUE, WHITE), lossless=True)
    save("a/mode_colour_key.png", upright, (RED, GREEN, WHITE, YELLOW), transparency=BLUE)
    save("b/mode_CMYK.jpg", upright.convert("CMYK"), quality=95)
    one = Image.fromarray(_quad(56, 40, ((0,), (255,), (255,), (0,)))).convert("1")
    save("a/mode_1.png", one, (BLACK, WHITE, WHITE, BLACK))
    save("b/mode_1.bmp", one, (BLACK, WHITE, WHITE, BLACK))
    _png16(root / "b" / "mode_I16.png", _quad(56, 40, ((0,), (1000,), (30000,), (65535,)), np.uint16))
    expect["b/mode_I16.png"] = ((0,) * 3, (4,) * 3, (117,) * 3, (255,) * 3)  # scaled as a viewer shows it, not clipped at 255
    # formats and upper-case extensions
    save("a/lossy.webp", upright, quality=95)
    save("b/plain.bmp", upright)
    for ext in ("JPG", "JPEG", "PNG", "WEBP", "BMP", "jfif", "JPE"):
        save(f"b/upper.{ext}", upright, **({"format": "JPEG", "quality": 95} if ext in ("JPG", "JPEG", "jfif", "JPE") else {"quality": 95} if ext == "WEBP" else {}))
    # what cannot be decoded
    good = (root / "a" / "big.JPEG").read_bytes()  # cut well past its header: the decoders see image data end early
    (root / "a" / "zz_truncated.jpg").write_bytes(good[: len(good) // 3])
    png = (root / "a" / "mode_RGBA.png").read_bytes()
    (root / "b" / "zz_truncated.png").write_bytes(png[: len(png) // 2])
    (root / "b" / "zz_text.png").write_text("not an image, named like one\n")
    (root / "a" / "zz_empty.JPG").write_bytes(b"")
    (root / "a" / "notes.txt").write_text("ignored: not an image extension")
    return expect


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(root, expected colours, files in cache order, the rgb build's splits, its cache, the gray build's cache)."""
    d = tmp_path_factory.mktemp("zoo")
    old = os.environ.get("MPSRUN_CACHE")
    os.environ["MPSRUN_CACHE"] = str(d / "cache")
    try:
        root = d / "photos"
        expect = _write_zoo(root)
        files = scan.scan_folder(root).all_files()
        splits = image_folder(str(root), size=SIZE, val_fraction=0.25)  # the real plugin: forked PIL workers
        rgb = cache_mod.open_or_build(files, SIZE, SIZE, "rgb")  # reopened: the same bytes the splits hold
        gray = image_folder(str(root), size=GRAY_SIZE, mode="gray", val_fraction=0.25, workers=1)  # decoded in this process
        gcache = cache_mod.open_or_build(files, GRAY_SIZE[0], GRAY_SIZE[1], "gray")
        yield root, expect, files, splits, rgb, gray, gcache
    finally:
        if old is None:
            os.environ.pop("MPSRUN_CACHE", None)
        else:
            os.environ["MPSRUN_CACHE"] = old


def _patches(img: np.ndarray) -> list[np.ndarray]:
    """Mean colour of a patch at the middle of each quadrant of a (C, H, W) image, away from the edges that blur."""
    _, h, w = img.shape
    rows, cols = (slice(h // 8, 3 * h // 8 + 1), slice(5 * h // 8, 7 * h // 8 + 1)), (slice(w // 8, 3 * w // 8 + 1), slice(5 * w // 8, 7 * w // 8 + 1))
    return [img[:, r, c].reshape(img.shape[0], -1).mean(axis=1) for r in rows for c in cols]


def _luma(rgb: tuple) -> tuple:
    return (round(0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]),)


def _check(img: np.ndarray, colours: tuple, name: str, to: Callable[[tuple], tuple] = lambda c: c) -> None:
    for where, got, want in zip(("top-left", "top-right", "bottom-left", "bottom-right"), _patches(img), colours):
        assert np.abs(got - np.asarray(to(want))).max() <= TOL, f"{name}: {where} is {got.round().tolist()}, a viewer shows {to(want)}"


def test_every_decodable_file_is_read_upright_in_its_colours(zoo) -> None:  # type: ignore[no-untyped-def]
    root, expect, files, splits, rgb, _, _ = zoo
    rel = [str(f.relative_to(root)) for f in files]
    assert sorted(set(rel) - set(expect)) == sorted(f"{'a' if n.endswith(('jpg', 'JPG')) else 'b'}/{n}" for n in CORRUPT)
    assert {rel[i] for i in rgb.bad} == set(rel) - set(expect)  # skipped: exactly the files that cannot be decoded
    assert splits.info["tags"]["mpsrun.data.skipped"] == str(len(CORRUPT))
    assert len(splits.train) + len(splits.val) == len(expect)
    for i, r in enumerate(rel):
        if r in expect:
            _check(rgb.images[i], expect[r], r)


def test_gray_mode_and_a_wide_target_read_every_file_upright(zoo) -> None:  # type: ignore[no-untyped-def]
    root, expect, files, _, _, gray, gcache = zoo
    rel = [str(f.relative_to(root)) for f in files]
    assert {rel[i] for i in gcache.bad} == set(rel) - set(expect)
    assert gray.info["tags"]["mpsrun.data.skipped"] == str(len(CORRUPT)) and gray.input_shape == (1, *GRAY_SIZE)
    for i, r in enumerate(rel):
        if r in expect:
            _check(gcache.images[i], expect[r], r + " (gray)", _luma)


def test_only_the_corrupt_files_are_named_on_screen_and_in_the_run(zoo, work) -> None:  # type: ignore[no-untyped-def]
    """The real CLI on the folder (the cache built above is reused): the note names files that cannot be decoded, in
    file order, and counts the rest; the run's tags say the same."""
    root = zoo[0]
    r = work.cli("run", RECIPES / "images_folder.yaml", f"dataset.root={root}", f"dataset.size={SIZE}", "device=cpu", "epochs=1",
                 "augment=[]", "model.channels=[4]", "tracking.log_model=false", "tracking.figures=false")
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.output.splitlines() if "unreadable" in ln]
    assert len(lines) == 1 and f"skipped {len(CORRUPT)} unreadable image(s): " in lines[0], r.output
    named = [n for n in os.listdir(root / "a") + os.listdir(root / "b") if f"/{n} (" in lines[0]]
    assert len(named) == 3 and set(named) <= set(CORRUPT) and lines[0].rstrip().endswith("and 1 more"), lines[0]
    first = [lines[0].index(f"/{n} (") for n in ("a/zz_empty.JPG", "a/zz_truncated.jpg", "b/zz_text.png")]
    assert first == sorted(first), lines[0]  # the first three in file order, whichever worker met them first
    assert "box offset" not in r.output
    (run,) = work.runs("images_folder")
    assert run.data.tags["mpsrun.data.skipped"] == str(len(CORRUPT))
    assert lines[0].split("images: ", 1)[-1] in run.data.tags.get("mpsrun.notes", ""), run.data.tags.get("mpsrun.notes")


def test_mode_I_and_F_images_come_out_as_a_viewer_shows_them() -> None:
    """Modes no listed format writes with PIL here, but PIL opens (a 16-bit PNG is 'I' in older Pillow): 32-bit integer
    gray is 16-bit scaled, floating point taken as 0-255, both clipped."""
    i = Image.fromarray(np.array([[0, 1000, 30000, 65535, 70000, -5]], np.int32), "I")
    assert np.asarray(decode._mode(i, gray=True)).tolist() == [[0, 4, 117, 255, 255, 0]]
    f = Image.fromarray(np.array([[0.0, 12.4, 255.0, 300.0, -1.0]], np.float32), "F")
    assert np.asarray(decode._mode(f, gray=False))[..., 0].tolist() == [[0, 12, 255, 255, 0]]


def _jpegs(root: Path, expect: dict[str, tuple]) -> list[str]:
    return sorted(str(root / r) for r in expect if decode.is_jpeg(r)) + [str(root / "a" / n) for n in ("zz_truncated.jpg", "zz_empty.JPG")]


def _gpu_path(zoo, device: str) -> None:  # type: ignore[no-untyped-def]
    """The GPU decoder's code over every JPEG: what nvJPEG would not show as a viewer does goes to PIL before decoding
    (counted by reason), the rest decodes on `device`; with PIL finishing what it was left, every row is upright and in
    its colours, and only the corrupt files stay unread."""
    root, expect = zoo[0], zoo[1]
    paths = _jpegs(root, expect)
    arr = np.zeros((len(paths), 3, SIZE, SIZE), np.uint8)
    claims = decode.Claims(len(paths))
    t = gpu_decode.Thread(paths, list(range(len(paths))), claims.back, arr, device=device)
    t.join()
    assert t.error is None and not t.absent
    rotated = sum(1 for p in paths if "orient" in p and "orient1" not in p)
    assert t.passed == {"EXIF orientation": rotated, "CMYK JPEG": 1, "not a JPEG header": 1, "no JPEG end marker": 1}, t.passed
    assert t.handed() == f" ({rotated + 3} given to PIL: CMYK JPEG 1, EXIF orientation {rotated}, no JPEG end marker 1, not a JPEG header 1)"
    left = dict(t.left)
    refused = sorted(Path(p).name for i, p in enumerate(paths) if i in left and "orient" not in p and "zz_" not in p and "CMYK" not in p)
    if device == "cpu":
        assert refused == [] and t.decoded - len(left) == len(paths) - rotated - 3  # all others on the decoder
    else:  # nvJPEG may refuse more (then PIL reads them, checked below); most plain JPEGs are its own
        assert t.decoded - len(left) >= (len(paths) - rotated - 3) // 2, f"nvJPEG refused {refused}"
    unread = []
    for i, p in enumerate(paths):
        if i in left:
            try:
                decode.load_into(p, arr[i])
            except Exception:
                unread.append(Path(p).name)
                continue
        _check(arr[i], expect[str(Path(p).relative_to(root))], f"{p} ({'PIL' if i in left else device})")
    assert sorted(unread) == ["zz_empty.JPG", "zz_truncated.jpg"]


def test_the_gpu_decoder_hands_what_it_would_show_wrongly_to_pil_run_with_the_cpu_decoder(zoo) -> None:  # type: ignore[no-untyped-def]
    """torchvision's CPU decoder in the GPU decoder's place (this machine has no CUDA): the same code, the same hand-over."""
    _gpu_path(zoo, "cpu")


@pytest.mark.skipif(not gpu_decode.available(), reason="needs a CUDA GPU for nvJPEG (torchvision.io.decode_jpeg on cuda)")
def test_the_gpu_decoder_hands_what_it_would_show_wrongly_to_pil_cuda(zoo) -> None:  # type: ignore[no-untyped-def]
    _gpu_path(zoo, "cuda")


@pytest.mark.skipif(not gpu_decode.available(), reason="needs a CUDA GPU for nvJPEG (torchvision.io.decode_jpeg on cuda)")
def test_a_build_shared_with_nvjpeg_reads_every_file_upright_cuda(zoo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole build on a CUDA machine with nvJPEG made to start at once (PIL slowed so it takes a share): the same
    files read, the same colours and orientations, the same files skipped as the CPU build."""
    root, expect, files = zoo[0], zoo[1], zoo[2]
    real = decode._decoded

    def slow(path: str, h: int, w: int, gray: bool):  # type: ignore[no-untyped-def]
        import time

        time.sleep(0.1)  # the workers are forked after this patch: they decode at this pace, nvJPEG takes the back
        return real(path, h, w, gray)

    monkeypatch.setattr(decode, "_decoded", slow)
    monkeypatch.setattr(cache_mod, "GPU_LOOK_S", 0.0)
    monkeypatch.setattr(cache_mod, "GPU_WORTH_S", 0.0)
    monkeypatch.setenv("MPSRUN_CACHE", str(tmp_path / "cache"))
    s = image_folder(str(root), size=SIZE, val_fraction=0.25, workers=2)
    assert "nvJPEG on the GPU: " in s.info["tags"]["mpsrun.data.decode"], s.info["tags"]["mpsrun.data.decode"]
    c = cache_mod.open_or_build(files, SIZE, SIZE, "rgb")
    rel = [str(f.relative_to(root)) for f in files]
    assert {rel[i] for i in c.bad} == set(rel) - set(expect)
    for i, r in enumerate(rel):
        if r in expect:
            _check(c.images[i], expect[r], r + " (nvJPEG build)")
