"""`image_folder` and `image_csv`: layouts, the decode-once cache, bad files and bad input.

Real files written with PIL, the real plugins and the real CLI; the cache lives in a
temporary $MPSRUN_CACHE. Small images (32 px) and few of them, so each decode is quick.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mpsrun.plugins.builtin.images import cache as cache_mod
from mpsrun.plugins.builtin.images.datasets import image_csv, image_folder
from mpsrun.testing.images import write

SIZE = 32


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("imgcache")
    old = os.environ.get("MPSRUN_CACHE")
    os.environ["MPSRUN_CACHE"] = str(d)
    yield d
    if old is None:
        os.environ.pop("MPSRUN_CACHE", None)
    else:
        os.environ["MPSRUN_CACHE"] = old


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """3 classes x 10 JPEGs, plus the awkward ones: a corrupt JPEG, an RGBA PNG, a grayscale JPEG, non-images."""
    root = write(tmp_path_factory.mktemp("imgs") / "shapes", classes=3, per_class=10, size=40)
    good = (root / "disc" / "0000.jpg").read_bytes()
    (root / "disc" / "zz_truncated.jpg").write_bytes(good[: len(good) // 3])  # a truncated JPEG
    rgba = np.zeros((40, 40, 4), np.uint8)
    rgba[:, :20] = (255, 0, 0, 255)  # left half opaque red, right half fully transparent
    Image.fromarray(rgba, "RGBA").save(root / "square" / "zz_alpha.png")
    Image.fromarray(np.full((40, 40), 77, np.uint8), "L").save(root / "cross" / "zz_gray.jpg", quality=100)
    (root / "disc" / "README.txt").write_text("not an image")
    (root / "square" / ".DS_Store").write_bytes(b"\0\1")
    return root




def test_folder_layout_classes_cache_and_awkward_files(folder: Path) -> None:
    s = image_folder(str(folder), size=SIZE, val_fraction=0.25)
    assert s.info["classes"] == ["cross", "disc", "square"] and s.num_classes == 3
    assert s.input_shape == (3, SIZE, SIZE)
    x_tr, y_tr = s.train.tensors
    x_va, y_va = s.val.tensors
    assert x_tr.dtype.is_floating_point is False and x_tr.shape[1:] == (3, SIZE, SIZE)
    assert len(y_tr) + len(y_va) == 32  # 30 + alpha PNG + gray JPEG; the truncated JPEG skipped, README/.DS_Store ignored
    assert sorted(set(y_va.tolist())) == [0, 1, 2]  # stratified
    assert s.info["tags"]["mpsrun.data.cache"] == "built"
    assert s.info["tags"]["mpsrun.data.skipped"] == "1"
    assert any("zz_truncated.jpg" in n for n in s.info["notes"])
    # the same files again: the cache is reused, the same bytes come back
    again = image_folder(str(folder), size=SIZE, val_fraction=0.25)
    assert again.info["tags"]["mpsrun.data.cache"] == "reused"
    assert again.info["cache"] == s.info["cache"]
    assert (again.train.tensors[0] == x_tr).all()
    cache = cache_mod.open_or_build(sorted(_files(folder)), SIZE, SIZE, "rgb")
    files = sorted(_files(folder))
    alpha = cache.images[files.index(folder / "square" / "zz_alpha.png")]
    assert alpha[:, :, :12].mean(axis=(1, 2)).round().tolist() == [255, 0, 0]  # opaque red stays red
    assert (alpha[:, :, -10:] == 255).all()  # transparent is put on white
    gray = cache.images[files.index(folder / "cross" / "zz_gray.jpg")]
    assert (gray[0] == gray[1]).all() and (gray[1] == gray[2]).all() and abs(int(gray[0].mean()) - 77) <= 1  # gray into RGB


def _files(root: Path) -> list[Path]:
    from mpsrun.plugins.builtin.images import scan

    return scan.scan_folder(root).all_files()


def test_on_bad_image_fail_names_the_file(folder: Path) -> None:
    with pytest.raises(ValueError, match=r"1 image\(s\) could not be decoded: .*zz_truncated.jpg"):
        image_folder(str(folder), size=SIZE, on_bad_image="fail")


def test_cache_rebuilt_after_a_file_changes_or_a_setting(tmp_path: Path, cache_dir: Path) -> None:
    root = write(tmp_path / "small", classes=2, per_class=4, size=24)
    a = image_folder(str(root), size=16, val_fraction=0.5)
    assert image_folder(str(root), size=16, val_fraction=0.5).info["tags"]["mpsrun.data.cache"] == "reused"
    p = root / "square" / "0001.jpg"
    Image.fromarray(np.zeros((24, 24, 3), np.uint8)).save(p)  # new content, size and mtime
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
    b = image_folder(str(root), size=16, val_fraction=0.5)
    assert b.info["tags"]["mpsrun.data.cache"] == "built" and b.info["cache"] != a.info["cache"]
    g = image_folder(str(root), size=16, mode="gray", val_fraction=0.5)
    assert g.info["tags"]["mpsrun.data.cache"] == "built" and g.input_shape == (1, 16, 16)


def test_split_layout_and_csv_with_names_and_integers(tmp_path: Path, cache_dir: Path) -> None:
    import shutil

    root = write(tmp_path / "split", classes=3, per_class=6, size=24, layout="split", val_per_class=2, fmt="png", csv=True)
    shutil.copytree(root / "val" / "disc", root / "test" / "disc")  # a test/ folder may hold some of the classes
    s = image_folder(str(root), size=[16, 20])
    assert s.input_shape == (3, 16, 20)
    assert len(s.val) == 6 and len(s.train) == 18  # val/ is the validation split as given
    assert s.test is not None and s.test.tensors[1].tolist() == [1, 1]  # test/disc: class index 1
    assert s.info["classes"] == ["cross", "disc", "square"]
    c = image_csv(str(root / "labels.csv"), size=16, val_fraction=0.25)  # paths relative to the CSV
    assert c.info["classes"] == ["cross", "disc", "square"] and len(c.train) + len(c.val) == 24
    lines = (root / "labels.csv").read_text().splitlines()
    names = {"disc": 0, "square": 1, "cross": 2}
    (root / "ints.csv").write_text("file;y\n".replace(";", ",") + "".join(f"{p},{names[lab]}\n" for p, lab in (l.split(",") for l in lines[1:])))
    i = image_csv(str(root / "ints.csv"), path_column="file", label_column="y", size=16, val_fraction=0.25)
    assert i.info["classes"] == ["0", "1", "2"] and i.num_classes == 3
    assert i.info["tags"]["mpsrun.data.cache"] == "reused"  # the same files and settings as the CSV above


BAD_RECIPE = """\
device: cpu
epochs: 1
batch_size: 8
dataset: {{name: {name}, {args}}}
model: {{name: cnn}}
optimizer: {{name: sgd, lr: 0.1}}
"""


@pytest.mark.parametrize(
    "case,make,args,expect",
    [
        ("missing root", None, "root: nowhere", "dataset.root 'nowhere' does not exist"),
        ("empty class", "empty", "root: {root}", "hold no images"),
        ("single class", "single", "root: {root}", "single class"),
        ("val label", "valextra", "root: {root}", "that train/ lacks"),
        ("csv column", "csv", "csv: {root}/labels.csv, label_column: lable", "no column 'lable' (did you mean 'label'?)"),
        ("missing csv", None, "csv: nowhere.csv", "dataset.csv 'nowhere.csv' does not exist"),
    ],
)
def test_bad_layouts_exit_2_before_decoding(work, cache_dir: Path, case: str, make: str | None, args: str, expect: str) -> None:
    root = work.path / "data"
    if make == "empty":
        write(root, classes=2, per_class=2, size=16)
        (root / "empty_class").mkdir()
    elif make == "single":
        write(root, classes=1, per_class=3, size=16)
    elif make == "valextra":
        write(root, classes=2, per_class=2, size=16, layout="split", val_per_class=1)
        write(root / "val" / "extra", classes=1, per_class=1, size=16)  # val/extra/disc/...: a class train/ lacks
    elif make == "csv":
        write(root, classes=2, per_class=2, size=16, csv=True)
    name = "image_csv" if "csv:" in args else "image_folder"
    p = work.write("bad.yaml", BAD_RECIPE.format(name=name, args=args.format(root=root)))
    before = set(cache_dir.rglob("*"))
    r = work.cli("run", p, "-q")
    assert r.exit_code == 2, r.output
    assert expect in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output
    assert set(cache_dir.rglob("*")) == before  # refused before any decoding
    assert work.runs("bad") == []  # and before any MLflow run


AUDIT = r"""
import os, sys
root = sys.argv[1]
opened = []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and str(os.fsdecode(args[0])).startswith(root):
        opened.append(os.fsdecode(args[0]))
sys.addaudithook(hook)
from mpsrun.plugins.builtin.images.datasets import image_folder
s = image_folder(root, size=24, workers=1, val_fraction=0.25)   # workers=1: decoded in this process, seen by the hook
built = len(opened); opened.clear()
t = image_folder(root, size=24, workers=1, val_fraction=0.25)
assert t.info["tags"]["mpsrun.data.cache"] == "reused"
x = t.train.tensors[0].float().sum() + t.val.tensors[0].float().sum()  # and read every pixel
print("opened", built, len(opened), int(x > 0))
"""


def test_a_cached_run_opens_no_image_file(tmp_path: Path) -> None:
    """An audit hook sees every file Python opens: the first build opens each image, the reuse none."""
    import subprocess

    root = write(tmp_path / "audit", classes=2, per_class=6, size=24)
    env = {**os.environ, "MPSRUN_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-c", AUDIT, str(root)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    _, built, reused, read = p.stdout.split()
    assert int(built) >= 12 and int(reused) == 0 and read == "1"


def test_the_nvjpeg_path_matches_pil_run_with_the_cpu_decoder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpu_decode` is the CUDA machine's decoder; its code (batching, crop, antialiased resize, refusals) runs here
    with torchvision's CPU decoder and must give PIL's pixels within resampling differences."""
    from mpsrun.plugins.builtin.images import decode, gpu_decode

    root = write(tmp_path / "nv", classes=2, per_class=3, size=48)
    files = sorted(str(p) for p in root.rglob("*.jpg"))
    wide = np.random.default_rng(3).integers(0, 256, (40, 72, 3), dtype=np.uint8)
    Image.fromarray(wide).save(root / "wide.jpg", quality=95)  # another size in the same batch: resized apart
    files.insert(1, str(root / "wide.jpg"))
    (root / "bad.jpg").write_bytes(b"\xff\xd8\xff garbage")
    files.append(str(root / "bad.jpg"))
    arr = np.zeros((len(files), 3, 32, 40), np.uint8)
    monkeypatch.setattr(gpu_decode, "BATCH", 2)  # several batches, read ahead while one decodes
    claims = decode.Claims(len(files))
    left = gpu_decode.decode_gpu(files, list(range(len(files))), claims.back, arr, device="cpu")
    assert left == [(len(files) - 1, str(root / "bad.jpg"))]  # refused: goes to PIL, which judges it
    for i, f in enumerate(files[:-1]):
        ref = decode.load(f, 32, 40, gray=False).astype(int)
        assert np.abs(arr[i].astype(int) - ref).mean() < 6, f


def test_pil_workers_and_the_gpu_thread_share_the_list_from_both_ends_run_with_the_cpu_decoder(tmp_path: Path) -> None:
    """The CUDA build's scheduling, here with torchvision's CPU decoder on the thread: forked PIL workers take from the
    front, the decoder thread from the back; every file decoded once, by one of them, to PIL's pixels."""
    from mpsrun.plugins.builtin.images import decode, gpu_decode

    root = write(tmp_path / "both", classes=2, per_class=40, size=40)
    paths = sorted(str(p) for p in root.rglob("*.jpg"))
    shape = (len(paths), 3, 32, 32)
    out = tmp_path / "map.u8"
    with open(out, "wb") as f:
        f.truncate(int(np.prod(shape)))
    ctx = decode.context()
    order = list(range(len(paths)))
    claims = decode.Claims(len(paths), ctx=ctx)
    arr = np.memmap(out, dtype=np.uint8, mode="r+", shape=shape)
    gpu_decode.BATCH, batch = 8, gpu_decode.BATCH

    import threading

    took = threading.Event()

    def back_after_the_front_began(k: int) -> range:  # both ends take a share however loaded the machine is
        got = claims.back(k)
        took.set()
        end = time.perf_counter() + 60
        while claims.lo.value == 0 and time.perf_counter() < end:
            time.sleep(0.01)
        return got

    try:
        gpu = gpu_decode.Thread(paths, order, back_after_the_front_began, arr, device="cpu")
        assert took.wait(60)  # its first claim made, then the workers start
        pool = decode.Workers(2, str(out), shape, paths, order, claims, ctx)
        while pool.poll(0.05):
            pass
        pool.join()
        claims.close()
        gpu.join()
    finally:
        gpu_decode.BATCH = batch
    assert gpu.error is None and gpu.left == [] and not pool.bad
    assert gpu.decoded > 0 and pool.done > 0 and gpu.decoded + pool.done == len(paths)  # no file twice, none missed
    assert sorted(gpu.claimed) == list(range(len(paths) - gpu.decoded, len(paths)))  # the thread's share is the back
    arr = np.memmap(out, dtype=np.uint8, mode="r", shape=shape)
    for i, p in enumerate(paths):
        assert np.abs(arr[i].astype(int) - decode.load(p, 32, 32, gray=False).astype(int)).mean() < 6, p


def test_a_gpu_decoder_that_cannot_start_is_said_and_tagged_simulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA here: the GPU path is switched on and its start made to fail (as a broken nvJPEG would); PIL decodes
    everything, and the screen, the notes and the decode tag say why. Without the simulation the same build says nothing."""
    from mpsrun.plugins.builtin.images import cache as cmod
    from mpsrun.plugins.builtin.images import decode, gpu_decode

    def broken(device: str, c: int) -> None:
        raise RuntimeError("nvJPEG unavailable (simulated)")

    monkeypatch.setenv("MPSRUN_CACHE", str(tmp_path / "cache"))
    root = write(tmp_path / "nogpu", classes=2, per_class=6, size=24)
    # a machine with no CUDA (this one, or a GPU machine told so): the decoder's thread finds none and the build is a
    # CPU machine's, nothing said
    monkeypatch.setattr(cmod, "_gpu_present", lambda: False)
    s = image_folder(str(root), size=16, workers=1, val_fraction=0.25)
    assert s.info["tags"]["mpsrun.data.decode"] == "PIL in 1 process(es): 12" and not s.info.get("notes")
    assert "gpu_init" not in s.info["tags"]["mpsrun.data.decode_phases"]

    # a CUDA machine (simulated): nvJPEG starts only where PIL alone would take longer than the GPU's start, and says so
    monkeypatch.setattr(gpu_decode, "available", lambda: True)
    monkeypatch.setattr(cmod, "_gpu_present", lambda: True)
    more = write(tmp_path / "more", classes=2, per_class=40, size=24)  # 80 files: two PIL processes
    monkeypatch.setenv("MPSRUN_CACHE", str(tmp_path / "cache2"))
    s = image_folder(str(more), size=16, workers=2, val_fraction=0.25)
    assert s.info["tags"]["mpsrun.data.decode"].startswith("nvJPEG not started: PIL ")
    assert s.info["tags"]["mpsrun.data.decode"].endswith("PIL in 2 process(es): 80") and not s.info.get("notes")

    # ... and when it starts but cannot (as a broken nvJPEG would): PIL decodes everything, said on screen and in the notes
    real = decode._decoded

    def slow(path: str, h: int, w: int, gray: bool):  # type: ignore[no-untyped-def]
        time.sleep(0.02)  # the workers are forked: they decode at this pace, so the build lasts past the GPU's decision
        return real(path, h, w, gray)

    monkeypatch.setattr(decode, "_decoded", slow)
    monkeypatch.setattr(cmod, "GPU_LOOK_S", 0.0)
    monkeypatch.setattr(cmod, "GPU_WORTH_S", 0.0)
    monkeypatch.setattr(gpu_decode, "warm", broken)
    monkeypatch.setenv("MPSRUN_CACHE", str(tmp_path / "cache3"))
    s = image_folder(str(more), size=16, workers=2, val_fraction=0.25)
    assert len(s.train) + len(s.val) == 80
    assert any("GPU decoding (nvJPEG) failed, PIL decoded its files instead: RuntimeError: nvJPEG unavailable" in n for n in s.info["notes"])
    assert s.info["tags"]["mpsrun.data.decode"] == "nvJPEG on the GPU: 0; PIL in 2 process(es): 80"
    assert "decode " in s.info["tags"]["mpsrun.data.decode_phases"] and "stats " in s.info["tags"]["mpsrun.data.decode_phases"]


def test_a_worker_that_dies_is_an_error_not_a_hang_and_leaves_no_cache_simulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoding process killed mid-build (simulated: it exits on one file, as an out-of-memory kill would) must end the
    build with an error naming what to do, leave no cache folder behind, and keep no worker running."""
    from mpsrun.plugins.builtin.images import decode

    real = decode._decoded

    def dies_on_one(path: str, h: int, w: int, gray: bool):  # type: ignore[no-untyped-def]
        if path.endswith("0003.jpg"):
            os._exit(9)
        return real(path, h, w, gray)

    monkeypatch.setattr(decode, "_decoded", dies_on_one)  # inherited by the forked workers
    monkeypatch.setattr(decode, "CHUNK", 4)
    cache = tmp_path / "cache"
    monkeypatch.setenv("MPSRUN_CACHE", str(cache))
    root = write(tmp_path / "dies", classes=2, per_class=40, size=24)
    import multiprocessing

    with pytest.raises(RuntimeError, match="image decoding worker ended without finishing"):
        image_folder(str(root), size=16, workers=2, val_fraction=0.25)
    assert [p.name for p in (cache / "images").iterdir() if not p.name.endswith(".lock")] == []
    assert multiprocessing.active_children() == []


def test_runs_starting_together_decode_once(tmp_path: Path, cache_dir: Path) -> None:
    """Two builders at once (DDP ranks, parallel bench cells): the lock lets one decode; the other reuses."""
    from concurrent.futures import ThreadPoolExecutor

    root = write(tmp_path / "together", classes=2, per_class=5, size=24)
    files = _files(root)
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: cache_mod.open_or_build(files, 16, 16, "rgb", workers=1), range(2)))
    assert sorted(c.status for c in got) == ["built", "reused"]
    assert (got[0].images == got[1].images).all()


def test_the_readme_command_writes_a_folder_the_recipe_reads(tmp_path: Path) -> None:
    """`python -m mpsrun.testing.images data/shapes` (README "Your own images"): class folders of JPEGs, seeded."""
    import subprocess

    for d in ("a", "b"):
        p = subprocess.run([sys.executable, "-m", "mpsrun.testing.images", str(tmp_path / d), "--per-class", "4", "--csv"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
    a, b = tmp_path / "a", tmp_path / "b"
    assert sorted(x.name for x in a.iterdir()) == ["cross", "disc", "labels.csv", "square"]
    assert len(list(a.rglob("*.jpg"))) == 12
    assert all((a / f.relative_to(b)).read_bytes() == f.read_bytes() for f in b.rglob("*.jpg"))  # same bytes
    from mpsrun.recipe import yaml_load

    assert yaml_load((Path(__file__).parents[1] / "recipes" / "images_folder.yaml").read_text())["dataset"]["root"] == "data/shapes"


def test_the_map_store_and_the_pwrite_store_write_the_same_cache(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers store one pwritev an image; MPSRUN_DECODE_STORE=map stores through a shared map (pages populated with
    MADV_POPULATE_WRITE), and a platform with neither through a plain map. All must give every image's bytes, at its
    own row, the same."""
    from mpsrun.plugins.builtin.images import decode

    files = sorted(_files(folder))
    probe = tmp_path / "probe"
    probe.write_bytes(bytes(8192))
    fd = os.open(probe, os.O_RDWR)
    try:  # this machine's kernel (>= 5.14) takes the advice, so the populated map is the one tested below
        mm, populate = decode._store_map(fd, 8192, want_map=True)
        assert decode._store_map(fd, 8192, want_map=False) == (None, False)  # the default: pwritev
        assert populate and mm is not None
        mm.close()
    finally:
        os.close(fd)
    got = {}
    for store in ("map", "pwrite", "plain map (simulated: no advice, no pwritev)"):
        with monkeypatch.context() as m:
            m.setenv("MPSRUN_CACHE", str(tmp_path / store.split()[0] / str(len(got))))
            m.setenv("MPSRUN_DECODE_STORE", store.split()[0])
            if store.startswith("plain"):  # a platform without either (the workers are forked: they see it too)
                m.setattr(decode, "MADV_POPULATE_WRITE", -1)
                m.delattr(os, "pwritev")
            got[store] = np.array(cache_mod.open_or_build(files, SIZE, SIZE, "rgb").images)
    assert got["map"].shape[0] == len(files) and got["map"].any(axis=(1, 2, 3)).sum() >= len(files) - 1  # all but the truncated one
    assert all((v == got["map"]).all() for v in got.values())
    for i in (0, len(files) // 2, len(files) - 2):  # rows at their own places
        if files[i].suffix == ".jpg" and "zz_" not in files[i].name:
            ref = decode.load(str(files[i]), SIZE, SIZE, gray=False)
            assert (got["map"][i] == ref).all(), files[i]
