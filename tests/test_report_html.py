"""``hetplan report``: one self-contained HTML page about a plan file, its
charts (report/svg.py), the what-if helper it shares with ``hetplan whatif``,
and the page as a real browser (headless Chromium) renders it."""

from __future__ import annotations

import contextlib
import html
import io
import json
import re
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import numpy as np
import pytest

from hetplan.cli import main
from hetplan.cluster.io import load_cluster
from hetplan.cluster.spec import ClusterSpec, NodeSpec
from hetplan.cost.model import CostModel
from hetplan.plan.workload import Workload
from hetplan.cost.memory import MEMORY_CATEGORIES
from hetplan.model.presets import get_model
from hetplan.plan.file import read_plan_file
from hetplan.report.html import SECTIONS, report_html, stage_labels
from hetplan.report.svg import MEMORY_COLOURS, memory_svg, text_width, timeline_svg
from hetplan.app.whatif import run_whatif
from hetplan.report.whatif import whatif_table
from hetplan.search import get_planner
from hetplan.search.baselines.uniform import uniform_plan
from hetplan.simulate.plan import makespan, simulate_plan

SVG_NS = "{http://www.w3.org/2000/svg}"
EVIL = '<script>alert("x")</script>'
HETPLAN = [sys.executable, "-m", "hetplan.cli"]


def quiet_main(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default ``hetplan plan`` (gpt2-amp on amp-heterogeneous) as a plan file."""
    path = tmp_path_factory.mktemp("report") / "plan.json"
    rc, _, err = quiet_main("plan", "--quiet", "--json", str(path))
    assert rc == 0, err
    return path


@pytest.fixture(scope="module")
def page(plan_path: Path) -> str:
    return report_html(read_plan_file(plan_path), 1, tokens=300e9, prices={"*": 2.0})


def svgs_of(page: str) -> list[ET.Element]:
    return [ET.fromstring(m) for m in re.findall(r"<svg .*?</svg>", page, re.S)]


def seconds_of(label: str) -> float:
    value, unit = label.split()
    return float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]


# --- the page ---------------------------------------------------------------------
def test_every_section_and_chart_is_there(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for sid, _ in SECTIONS:
        if sid not in ("whatif", "choose"):
            assert f'<section id="{sid}">' in page, sid
    assert '<section id="whatif">' not in page  # only with --vary
    assert '<section id="choose">' not in page and 'href="#choose"' not in page  # only with --choose
    assert page.count("<svg") == 3  # step time bar, pipeline timeline, memory per GPU
    for text in ("model    gpt2-amp", "cluster  amp-heterogeneous", "samples/step, bf16", "Why this plan",
                 "time goes to", "peak mem/GPU", "GPU-hours per billion tokens", "days", "$"):
        assert text in page, text
    # self-contained: no script, no external stylesheet, font or image
    assert "<script" not in page and "<link" not in page and "@import" not in page and "url(" not in page
    assert not re.search(r"""(src|href)=["'](?!#)""", page)
    assert len(svgs_of(page)) == 3  # each chart is well-formed XML


def test_every_plan_of_the_file_is_re_estimated(plan_path: Path, page: str) -> None:
    data = json.loads(plan_path.read_text())
    pf = read_plan_file(plan_path)
    assert len(pf.plans) == len(data["plans"]) >= 2
    table = re.search(r'<section id="alternatives">.*?<pre>(.*?)</pre>', page, re.S).group(1)
    for k, entry in enumerate(data["plans"], 1):
        estimate = CostModel(pf.workload(k)).estimate(pf.plan(k))
        assert estimate.iteration_time_s == pytest.approx(entry["estimate"]["iteration_time_s"])
        ms = f"{estimate.iteration_time_s * 1e3:.2f} ms"
        assert re.search(rf"^(<strong>)?{k} .*{re.escape(ms)}", table, re.M), (k, ms)
    assert re.search(r"^<strong>1 ", table, re.M)  # the described plan is highlighted
    other = report_html(pf, 3)
    assert re.search(r"^<strong>3 ", re.search(r'<section id="alternatives">.*?</pre>', other, re.S).group(0), re.M)


def test_user_strings_are_escaped(plan_path: Path, tmp_path: Path) -> None:
    data = json.loads(plan_path.read_text())
    data["model_spec"]["name"] = f"gpt{EVIL}"
    data["model_spec"]["layers"][0]["name"] = f"embed{EVIL}"
    data["cluster_spec"]["name"] = f"lab{EVIL}"
    data["plans"][0]["plan"]["notes"] = [f"note {EVIL}"]
    for entry in data["plans"]:  # each plan names the specs the file embeds (hetplan.plan.file)
        entry["plan"]["model"], entry["plan"]["cluster"] = f"gpt{EVIL}", f"lab{EVIL}"
    path = tmp_path / f"p{'<b>'}.json"
    path.write_text(json.dumps(data))
    page = report_html(read_plan_file(path), 1)
    assert "<script" not in page and "<b>" not in page
    escaped = "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"
    for text in (f"gpt{escaped}", f"embed{escaped}", f"lab{escaped}", f"note {escaped}", "p&lt;b&gt;.json"):
        assert text in page, text
    assert page.count("<svg") == 3


# --- the charts -----------------------------------------------------------------------
def _timeline(workload: Workload, plan) -> tuple[ET.Element, float, float]:
    cost = CostModel(workload)
    estimate = cost.estimate(plan)
    events = simulate_plan(cost, plan, estimate)
    svg = timeline_svg(events, stage_labels(plan, workload), plan.describe(), estimate.iteration_time_s)
    return ET.fromstring(svg), estimate.iteration_time_s, makespan(events)


def _axis(root: ET.Element) -> tuple[float, float, float]:
    """The time axis: x of 0, x of its end, and the end's time (from the tick labels)."""
    ticks = [t for t in root.iter(f"{SVG_NS}text") if t.get("class") == "tick"]
    assert ticks[0].text == "0"
    return float(ticks[0].get("x")), float(ticks[-1].get("x")), seconds_of(ticks[-1].text)


@pytest.mark.parametrize("case", ["simulated-later", "table-later"])
def test_timeline_axis_reaches_the_table_time_and_marks_it(case: str) -> None:
    workload = Workload(get_model("gpt2-amp"), load_cluster("amp-heterogeneous"), 32)
    if case == "simulated-later":  # GPipe over 1 Gbps: each phase waits on the link longer than the table charges
        slow = ClusterSpec("two-slow", tuple(NodeSpec("A100-40GB", 1, 600.0, 1.0, name=f"n{i}") for i in range(2)), 1.0)
        workload = Workload(get_model("tiny-gpt"), slow, 2048)
        plan = uniform_plan(workload, 1, 1, 2, 256, schedule="gpipe")
    else:  # little pipeline, much gradient sync: the table's step ends after the simulated pipeline
        plan = uniform_plan(workload, 8, 1, 2, 1)
    root, table_s, simulated_s = _timeline(workload, plan)
    assert (simulated_s > table_s) == (case == "simulated-later")
    x0, x_end, axis_end_s = _axis(root)
    assert axis_end_s >= table_s * (1 - 1e-4)  # labels are rounded to 0.01 ms
    assert axis_end_s == pytest.approx(max(table_s, simulated_s), rel=1e-4)
    marker = [m for m in root.iter(f"{SVG_NS}line") if m.get("class") == "table-time"]
    assert len(marker) == 1 and float(marker[0].get("data-seconds")) == table_s
    assert float(marker[0].get("x1")) == pytest.approx(x0 + (x_end - x0) * table_s / axis_end_s, abs=0.2)
    labels = [t.text for t in root.iter(f"{SVG_NS}text") if t.text and t.text.startswith("step time in the table")]
    assert labels == [f"step time in the table: {table_s * 1e3:.2f} ms"]
    assert_nothing_clipped(root)


def test_timeline_without_table_time_still_draws() -> None:  # what older callers pass
    workload = Workload(get_model("gpt2-amp"), load_cluster("amp-heterogeneous"), 32)
    plan = uniform_plan(workload, 4, 1, 4, 1)
    cost = CostModel(workload)
    events = simulate_plan(cost, plan)
    root = ET.fromstring(timeline_svg(events, [f"stage {j}" for j in range(plan.pp)], plan.describe()))
    assert _axis(root)[2] == pytest.approx(makespan(events), rel=1e-4)
    assert not [m for m in root.iter(f"{SVG_NS}line") if m.get("class") == "table-time"]
    assert_nothing_clipped(root)


MEMORY_CASES = [("gpt2-amp", "amp-heterogeneous", 32, "auto"), ("gpt3-1.3b", "metis-t4-v100-16", 64, "metis"),
                ("tiny-gpt", "1xA100-80GB", 8, "uniform"), ("gpt3-1.3b", "2xT4", 8, "amp")]


@pytest.mark.parametrize("model, cluster, gbs, planner", MEMORY_CASES, ids=[c[1] for c in MEMORY_CASES])
def test_memory_bars_stack_by_category_to_the_peak(model: str, cluster: str, gbs: int, planner: str) -> None:
    workload = Workload(get_model(model), load_cluster(cluster), gbs)
    ranked = get_planner(planner).plan(workload, 1)[0]
    plan, estimate = ranked.plan, ranked.estimate
    title = f"peak memory per GPU: {plan.describe()}"
    root = ET.fromstring(memory_svg(plan, estimate, workload, title))
    groups = [g for g in root.iter(f"{SVG_NS}g") if g.get("class") == "gpu"]
    assert sorted(int(g.get("data-device")) for g in groups) == sorted(estimate.peak_memory_bytes)
    for g in groups:
        device = int(g.get("data-device"))
        peak, cap = estimate.peak_memory_bytes[device], estimate.memory_capacity_bytes[device]
        segments = [r for r in g.iter(f"{SVG_NS}rect") if r.get("data-category")]
        capacity = [r for r in g.iter(f"{SVG_NS}rect") if r.get("class") == "capacity"]
        assert [r.get("data-category") for r in segments] == \
            [k for k in MEMORY_CATEGORIES if any(r.get("data-category") == k for r in segments)]
        for r in segments:  # one colour per category
            assert r.get("fill") == MEMORY_COLOURS[r.get("data-category")]
        assert sum(int(r.get("data-bytes")) for r in segments) == pytest.approx(peak, abs=8)
        px_per_byte = float(capacity[0].get("height")) / cap
        heights = sum(float(r.get("height")) for r in segments)
        assert heights == pytest.approx(peak * px_per_byte, abs=0.05)
        # stacked: each segment starts where the one below ends, the lowest on the capacity's base
        base = float(capacity[0].get("y")) + float(capacity[0].get("height"))
        for r in segments:
            assert float(r.get("y")) + float(r.get("height")) == pytest.approx(base, abs=0.02)
            base = float(r.get("y"))
    legend = [t.text for t in root.iter(f"{SVG_NS}text")]
    assert all(k in legend for k in MEMORY_CATEGORIES) and "capacity" in legend
    types = [t.text for t in root.iter(f"{SVG_NS}text") if t.get("class") == "gpu-type"]
    assert types == ["+".join(sorted({workload.cluster.devices[d].gpu.name for d in s.devices}))
                     for s in plan.stages]
    assert_nothing_clipped(root)


def assert_nothing_clipped(root: ET.Element) -> None:
    """Every rect, line and text inside [0, width] (text by ``text_width``, per its anchor)."""
    width = float(root.get("width"))
    for el in root.iter():
        tag = el.tag.replace(SVG_NS, "")
        if tag == "rect" and el.get("width") != "100%":
            x, w = float(el.get("x", 0)), float(el.get("width"))
            assert x >= 0 and x + w <= width + 1e-6, (ET.tostring(el)[:200], width)
        elif tag == "line":
            assert 0 <= min(float(el.get("x1")), float(el.get("x2")))
            assert max(float(el.get("x1")), float(el.get("x2"))) <= width, ET.tostring(el)[:200]
        elif tag == "text" and el.text:
            x = float(el.get("x"))
            w = text_width(el.text, float(el.get("font-size", 11)))
            start = {"start": x, "middle": x - w / 2, "end": x - w}[el.get("text-anchor", "start")]
            assert start >= 0 and start + w <= width + 1e-6, (el.text, x, w, width)


def test_no_chart_of_the_page_is_clipped(page: str) -> None:
    for root in svgs_of(page):
        assert_nothing_clipped(root)


def test_memory_chart_of_one_gpu_keeps_its_title() -> None:  # the title used to be clipped with few GPUs
    workload = Workload(get_model("tiny-gpt"), load_cluster("1xA100-80GB"), 8)
    plan = uniform_plan(workload, 1, 1, 1, 8)
    title = f"peak memory per GPU: {plan.describe()}"
    svg = memory_svg(plan, CostModel(workload).estimate(plan), workload, title)
    root = ET.fromstring(svg)
    assert float(root.get("width")) >= 4 + text_width(title, 13)
    assert_nothing_clipped(root)


# --- what-if ------------------------------------------------------------------------
def test_whatif_helper_prints_what_hetplan_whatif_prints() -> None:
    args = ["--model", "tiny-gpt", "--cluster", "8xA100-80GB", "--global-batch", "16", "--planner", "megatron",
            "--tokens", "1B", "--price-per-gpu-hour", "2"]
    rc, out, err = quiet_main("whatif", *args, "--vary", "gpus=4,8,3")
    assert rc == 0, err
    # the CLI plans for the code that trains a model the runtime builds (export.target.plan_target)
    base = Workload(get_model("tiny-gpt"), load_cluster("8xA100-80GB"), 16, target="hetplan")
    results = run_whatif(base, "gpus", ["4", "8", "3"], get_planner("megatron"), 1e9, {"*": 2.0})
    table = whatif_table(results, 1e9)
    assert out.rstrip().endswith(table)


# --- the command line ---------------------------------------------------------------
def test_report_command(plan_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    rc, stdout, err = quiet_main("report", str(plan_path), "-o", str(out), "--tokens", "300B",
                                 "--price-per-gpu-hour", "V100-16GB=2.5,T4=0.9", "--vary", "global-batch=16,64")
    assert rc == 0, err
    assert stdout.strip() == f"wrote {out}"
    page = out.read_text()
    assert '<section id="whatif">' in page and "global-batch=16" in page and "global-batch=64" in page
    assert page.count("<svg") == 3
    # time and cost to train as 'hetplan plan' prints them
    rc, plan_out, err = quiet_main("estimate", str(plan_path), "--tokens", "300B",
                                   "--price-per-gpu-hour", "V100-16GB=2.5,T4=0.9")
    assert rc == 0, err
    lines = [line[2:] for line in plan_out.splitlines() if re.match(r"- \w", line)]
    assert any("days" in line for line in lines) and any("$" in line for line in lines)
    for line in lines:
        assert f"<li>{html.escape(line)}</li>" in page, line


def test_plan_then_report_on_the_command_line(tmp_path: Path) -> None:
    plan, report = tmp_path / "p.json", tmp_path / "r.html"
    made = subprocess.run([*HETPLAN, "plan", "--quiet", "--top", "2", "--json", str(plan)], capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    result = subprocess.run([*HETPLAN, "report", str(plan), "-o", str(report), "--index", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert report.read_text().count("<svg") == 3


@pytest.mark.parametrize("args, message", [
    (["--index", "99"], "plan(s); use --index 1.."),
    (["--index", "0"], "must be positive"),
    (["--vary", "gpus=8,16"], "mixes GPU types"),
    (["--vary", "nodes=2"], "--vary takes WHAT=V1,V2"),
    (["--price-per-gpu-hour", "H100=4"], "which the cluster does not have"),
])
def test_bad_options_are_one_line_errors(plan_path: Path, tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "r.html"
    result = subprocess.run([*HETPLAN, "report", str(plan_path), "-o", str(out), *args], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("hetplan: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert not out.exists()


def test_missing_plan_file_is_a_one_line_error(tmp_path: Path) -> None:
    rc, _, err = quiet_main("report", str(tmp_path / "nope.json"), "-o", str(tmp_path / "r.html"))
    assert rc == 2 and err.startswith("hetplan: error: ") and err.count("\n") == 1


# --- a real browser -------------------------------------------------------------------
def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def png_pixels(path: Path) -> np.ndarray:
    """The PNG's pixels (8-bit RGB or RGBA, not interlaced: what Chromium writes) as an (h, w, channels) array."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    stride = width * bpp
    raw = zlib.decompress(b"".join(idat))
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for r in range(height):
        kind, line = raw[r * (stride + 1)], raw[r * (stride + 1) + 1:(r + 1) * (stride + 1)]
        cur = np.frombuffer(line, dtype=np.uint8).copy()
        if kind == 2:  # up
            cur = cur + prev
        elif kind in (1, 3, 4):  # sub, average, Paeth: each byte needs the one bpp before it
            up, row = prev.tobytes(), bytearray(line)
            for i in range(stride):
                left = row[i - bpp] if i >= bpp else 0
                if kind == 1:
                    pred = left
                elif kind == 3:
                    pred = (left + up[i]) // 2
                else:
                    corner = up[i - bpp] if i >= bpp else 0
                    p = left + up[i] - corner
                    pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - corner)
                    pred = left if pa <= pb and pa <= pc else up[i] if pb <= pc else corner
                row[i] = (row[i] + pred) & 0xFF
            cur = np.frombuffer(bytes(row), dtype=np.uint8).copy()
        else:
            assert kind == 0, f"bad filter {kind}"
        out[r], prev = cur, cur
    return out.reshape(height, width, bpp)


def test_png_decoder_on_a_known_image(tmp_path: Path) -> None:
    """The decoder itself, on every filter type, against pixels it was made from."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    rows = []
    for r, kind in enumerate((0, 1, 2, 3, 4)):
        cur = pixels[r].reshape(-1).astype(int)
        up = pixels[r - 1].reshape(-1).astype(int) if r else np.zeros_like(cur)
        left = np.concatenate([[0] * 3, cur[:-3]])
        upleft = np.concatenate([[0] * 3, up[:-3]])
        if kind == 4:
            p = left + up - upleft
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - upleft)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, upleft))
        else:
            pred = [np.zeros_like(cur), left, up, (left + up) // 2][kind]
        rows.append(bytes([kind]) + bytes(((cur - pred) % 256).astype(np.uint8)))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    path = tmp_path / "k.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 7, 5, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b""))
    assert (png_pixels(path) == pixels).all()


def test_page_renders_in_a_real_browser(page: str, tmp_path: Path) -> None:
    chromium = _chromium()
    if chromium is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; 'make install' does it as root)")
    html = tmp_path / "report.html"
    html.write_text(page, encoding="utf-8")
    shot = tmp_path / "shot.png"
    common = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,3000"]
    result = subprocess.run([*common, f"--screenshot={shot}", "--enable-logging=stderr", "--v=0",
                             html.as_uri()], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line]
    assert not console, console  # the page has no script: any console message is an error
    pixels = png_pixels(shot)
    assert pixels.shape[:2] == (3000, 1280)
    rgb = pixels[..., :3].astype(np.uint32)
    colours = np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2])
    not_white = (rgb.sum(axis=2) < 3 * 250).mean()
    assert len(colours) > 50 and not_white > 0.02, (len(colours), not_white)
    # the chart colours reached the screen
    for colour in (MEMORY_COLOURS["activations"], MEMORY_COLOURS["optimizer"]):
        value = int(colour[1:], 16)
        assert value in set(colours.tolist()), colour
    dom = subprocess.run([*common, "--dump-dom", html.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<svg") == page.count("<svg") == 3
    for sid, _ in SECTIONS:
        if sid not in ("whatif", "choose"):  # only with --vary, --choose
            assert f'id="{sid}"' in dom.stdout
