"""``fagen explain``: the facts (tile counts against the masking rule element by element, each
CTA's walk, the smem layout), the self-contained page, the CLI, and the page in a real
headless browser (skipped where no Chromium is installed; see docs/explain.md)."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fagen import KernelSpec, masking
from fagen.cli import main
from fagen.errors import InputError, InputTypeError
from fagen.explain import explain, render_html, write_html

DOC_KEYS = ("fagen_version", "name", "kernel", "spec", "direction", "head_dim", "dtype", "causal", "key_padding",
            "dropout", "arch", "seqlen_q", "seqlen_k", "block_r", "block_c", "paper_block_r", "paper_block_c",
            "sram_bytes", "tile_choice", "smem", "grid", "tiles", "tile_map", "cta_ranges", "kernels",
            "algorithm4", "hbm", "resources", "source")


def brute_force_counts(nq: int, nk: int, br: int, bc: int, causal: bool, key_padding: bool) -> dict[str, int]:
    """Per tile, every element through ``masking.allowed`` (all keys taking part)."""
    tr, tc = math.ceil(nq / br), math.ceil(nk / bc)
    visited = full = 0
    for i in range(tr):
        for j in range(tc):
            cells = [masking.allowed(r, c, nq, nk, causal=causal)
                     for r in range(i * br, i * br + br) for c in range(j * bc, j * bc + bc)]
            visited += any(cells)
            full += all(cells) and not key_padding
    return {"total": tr * tc, "visited": visited, "skipped": tr * tc - visited, "fully_visible": full}


SHAPES = [  # direction, causal, key_padding, Nq, Nk, B_r, B_c
    ("bwd", True, False, 100, 100, 16, 32),
    ("bwd", True, False, 70, 130, 16, 32),
    ("bwd", True, False, 130, 70, 32, 16),
    ("bwd", False, False, 77, 45, 16, 16),
    ("fwd", True, False, 96, 160, 32, 32),
    ("fwd", True, True, 50, 33, 16, 16),
    ("bwd", True, True, 1, 90, 16, 32),
    ("bwd", True, False, 90, 1, 16, 16),
]


@pytest.mark.parametrize("direction,causal,kpad,nq,nk,br,bc", SHAPES)
def test_tiles_match_the_masking_rule(direction: str, causal: bool, kpad: bool, nq: int, nk: int, br: int, bc: int) -> None:
    spec = KernelSpec(direction=direction, head_dim=32, causal=causal, key_padding=kpad, block_r=br, block_c=bc)
    f = explain(spec, nq, nk, with_resources=False)
    want = brute_force_counts(nq, nk, br, bc, causal, kpad)
    assert f["tiles"] == want
    # the drawn map has the same counts, tile by tile
    letters = {"s": 0, "p": 0, "f": 0}
    for i, runs in enumerate(f["tile_map"]):
        assert runs[0][1] == 0 and runs[-1][2] == f["grid"]["kv_blocks"]
        for (a, _, e), (_, b, _) in zip(runs, runs[1:]):
            assert e == b  # contiguous, no gaps
        for letter, j0, j1 in runs:
            letters[letter] += j1 - j0
    assert letters == {"s": want["skipped"], "p": want["visited"] - want["fully_visible"], "f": want["fully_visible"]}
    # every CTA walks exactly the visited tiles of its band
    kind = {(i, j): letter for i, runs in enumerate(f["tile_map"]) for letter, j0, j1 in runs for j in range(j0, j1)}
    walked = set()
    for cta, (first, end) in enumerate(f["cta_ranges"]):
        for blk in range(first, end):
            walked.add((blk, cta) if direction == "bwd" else (cta, blk))
    assert len(walked) == want["visited"] == sum(e - b for b, e in f["cta_ranges"])
    assert all(kind[t] != "s" for t in walked)


def test_facts_keys_smem_and_tile_choice() -> None:
    # the SIMT family: its paper point (64, 128) does not fit 64 KiB, so the tile shrinks
    spec = KernelSpec(head_dim=64, dtype="float16", causal=True, sram_bytes=65536, impl="simt")
    f = explain(spec, 1000, 1500, with_resources=False)
    for key in DOC_KEYS:
        assert key in f, key
    assert f["kernel"] == f"{spec.name}_main" and f["block_r"] == spec.tile.block_r and f["block_c"] == spec.tile.block_c
    assert set(f["tiles"]) == {"total", "visited", "skipped", "fully_visible"}
    assert [(b["name"], b["offset"], b["bytes"]) for b in f["smem"]["buffers"]] == \
        [(b.name, b.offset, b.nbytes) for b in spec.smem_layout.buffers]
    assert f["smem"]["total_bytes"] == spec.smem_bytes <= f["smem"]["capacity_bytes"] == 65536
    tc = f["tile_choice"]
    assert (tc["paper"]["block_r"], tc["paper"]["block_c"]) == (64, 128)
    assert not tc["paper"]["fits"] and tc["used"]["fits"]  # the paper's point does not fit with this layout
    assert "65536" in tc["reasons"]["block_c"] or "65536" in tc["reasons"]["block_r"]
    alg = f["algorithm4"]
    assert alg["prologue"] == [1, 7, 8] and 24 in alg["epilogue"]
    assert {10, 11, 16, 21, 22} <= set(alg["loop"]) and 19 in alg["other_kernels"]
    assert set(alg["buffers"]["7"]) == {"k", "v"} and "dk" in alg["buffers"]["22"]
    assert json.loads(json.dumps(f)) == f
    h = f["hbm"]
    assert h["flash_accesses"] == pytest.approx(1000 * 1500 * 64 * 64 / (65536 // 2))
    assert h["model_bytes"] > 0


def test_bad_arguments_name_themselves() -> None:
    spec = KernelSpec(head_dim=32)
    with pytest.raises(InputError, match="^seqlen_q: expected at least 1, got 0$"):
        explain(spec, 0, 10)
    with pytest.raises(InputTypeError, match="^seqlen_k: expected an int, got float$"):
        explain(spec, 10, 2.5)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match="^spec: "):
        explain({"head_dim": 32}, 10)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="^seqlen_q: expected at most"):
        explain(spec, 1 << 20, 1 << 20)


# --------------------------------------------------------------------------- the page
class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.scripts: list[str] = []
        self._in_script: dict[str, str] | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = {k: (v or "") for k, v in attrs}
        self.tags.append((tag, a))
        if tag == "script":
            self._in_script = a
            self.scripts.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = None

    def handle_data(self, data: str) -> None:
        if self._in_script is not None:
            self.scripts[-1] += data

    def find(self, tag: str, cls: str | None = None, **attrs: str) -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == tag and (cls is None or cls in a.get("class", "").split())
                and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]


@pytest.mark.parametrize("direction,causal,kpad", [("bwd", True, False), ("bwd", False, False), ("fwd", True, True)])
def test_page_content_and_structure(direction: str, causal: bool, kpad: bool) -> None:
    spec = KernelSpec(direction=direction, head_dim=64, dtype="float16", causal=causal, key_padding=kpad)
    f = explain(spec, 1000, 1500, with_resources=False)
    page = render_html(f)
    p = _Page()
    p.feed(page)
    p.close()
    # self-contained: no external resources
    for tag, a in p.tags:
        for attr in ("src", "href"):
            v = a.get(attr, "")
            assert not v.startswith(("http:", "https:", "//")), (tag, attr, v)
        assert tag not in ("link", "iframe", "img") or not a.get("src", "").strip(), tag
    ids = {a["id"] for _, a in p.tags if "id" in a}
    internal = [a["href"] for _, a in p.tags if a.get("href", "").startswith("#")]
    assert internal and all(h[1:] in ids for h in internal)  # every in-page link has a target
    assert len(p.find("a", href=f"#L{f['algorithm4']['kernel_lines'][f['kernel']][0]}")) == 1  # the main kernel
    # tiles: the drawn runs add up to the masking rule's counts
    drawn = {k: sum(int(a["data-j1"]) - int(a["data-j0"]) for a in p.find("rect", k)) for k in ("s", "p", "f")}
    t = f["tiles"]
    assert drawn == {"s": t["skipped"], "p": t["visited"] - t["fully_visible"], "f": t["fully_visible"]}
    counts = p.find("p", id="tile-counts")[0]
    assert {k: int(counts[f"data-{k.replace('_', '-')}"]) for k in t} == t
    assert (t["skipped"] > 0) == causal
    # the smem bar: one rect per buffer at the layout's offset and size
    bar = [(a["data-name"], int(a["data-offset"]), int(a["data-bytes"])) for a in p.find("rect", "buf")]
    assert bar == [(b.name, b.offset, b.nbytes) for b in spec.smem_layout.buffers]
    # the step control and the Algorithm 4 list
    for control in ("cta", "step", "prev", "next", "play"):
        assert p.find("input", id=control) or p.find("button", id=control), control
    shown = {a["data-line"] for a in p.find("li", "alg4-line") if "absent" not in a["class"].split()}
    alg = f["algorithm4"]
    assert shown == {str(n) for n in alg["prologue"] + alg["loop"] + alg["epilogue"]} - {"23"}  # 23: no code
    # the source, with Algorithm 4 comments linked to the step view
    anchors = p.find("a", "alg4")
    linked = {int(n) for a in anchors for n in a["data-alg4"].split()}
    assert linked == {n for a in alg["anchors"] for n in a["alg4"]}
    if direction == "bwd":
        assert {"7", "10", "21", "24"} <= shown and {7, 8, 10, 16, 19, 21, 22, 24} <= linked
    else:
        assert p.find("p", id="fwd-note")
    assert all(a["href"] == "#tiles" for a in anchors)
    assert len(p.find("span", "ln")) == len(f["source"].splitlines())
    # the page renders from the embedded facts
    data = [s for (tag, a), s in zip([x for x in p.tags if x[0] == "script"], p.scripts) if a.get("id") == "fagen-facts"]
    assert json.loads(data[0]) == f


def test_source_highlighting_keeps_the_text() -> None:
    import html as html_mod
    import re

    from fagen.explain.page import highlight

    src = 'int x = 1; // Algorithm 4 line 7: load\n/* two\nlines */ float y = "s<t>";\n#include <a.h>\n'
    out = highlight(src)
    text = html_mod.unescape(re.sub(r"<[^>]+>", "", out.replace('</span><span class="ln"', '</span>\n<span class="ln"')))
    assert text == src.rstrip("\n")
    assert 'data-alg4="7"' in out and out.count('class="ln"') == 4


# --------------------------------------------------------------------------- CLI
def test_cli_json_and_html(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out.html"
    rc = main(["explain", "--head-dim", "64", "--dtype", "float16", "--causal", "--seqlen-q", "1000",
               "--seqlen-k", "1500", "--html", str(out), "--json"])
    assert rc == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["tiles"] == brute_force_counts(1000, 1500, facts["block_r"], facts["block_c"], True, False)
    main_res = [k for k in facts["resources"]["kernels"] if k["kernel"] == facts["kernel"]]
    assert main_res and main_res[0]["registers"] > 0 and main_res[0]["smem_bytes"] == facts["smem"]["total_bytes"]
    assert 0 < main_res[0]["occupancy"]["fraction"] <= 1
    assert out.read_text(encoding="utf-8") == render_html(facts)


@pytest.mark.parametrize("args,option", [
    (["--seqlen-q", "0", "--json"], "--seqlen-q"),
    (["--seqlen-k", "-3", "--json"], "--seqlen-k"),
    ([], "--html"),
    (["--html", "/nonexistent-dir/x.html"], "--html"),
    (["--block-r", "24", "--json"], "--block-r"),
])
def test_cli_errors(args: list[str], option: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["explain", "--head-dim", "32", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fagen: error: {option}") and "\n" not in err


# --------------------------------------------------------------------------- a real browser
def _chromium() -> str | None:
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium (apt-get install chromium; see docs/explain.md)")
def test_page_in_headless_chromium(tmp_path: Path) -> None:
    spec = KernelSpec(head_dim=64, dtype="float16", causal=True)
    facts = explain(spec, 1000, 1500, with_resources=False)
    page = write_html(facts, tmp_path / "page.html")
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}"]
    url = page.as_uri() + "#cta=5&step=3"

    def dom_of(u: str) -> tuple[str, str]:
        dom = subprocess.run([*base, "--dump-dom", u], capture_output=True, text=True, timeout=120).stdout
        html_tag = re.search(r"<html[^>]*>", dom)
        return dom, html_tag.group() if html_tag else ""

    # the error probe works: a page whose facts do not parse reports it and never gets ready
    broken = tmp_path / "broken.html"
    text = page.read_text(encoding="utf-8")
    start = text.index('id="fagen-facts">') + len('id="fagen-facts">')
    broken.write_text(text[:start] + "{" + text[text.index("</script>", start):], encoding="utf-8")
    dom, html_tag = dom_of(broken.as_uri())
    assert "data-js-errors" in html_tag and 'data-ready="1"' not in dom

    dom, html_tag = dom_of(url)
    assert 'data-ready="1"' in dom, dom[-2000:]  # the script ran to its end
    assert "data-js-errors" not in html_tag, html_tag
    # the step control walked CTA 5 (K/V block 5) to the third Q block of its range
    first, end = facts["cta_ranges"][5]
    assert end - first >= 3
    assert f"CTA 5, step 3 of {end - first}:" in dom and f"tile (Q block {first + 2}, K/V block 5)" in dom
    # the lines of that step are highlighted; the mask (line 12) only where the tile needs mask math
    kind = next(k for k, j0, j1 in facts["tile_map"][first + 2] if j0 <= 5 < j1)

    def on(line: int) -> bool:
        tag = re.search(rf'<li[^>]*id="alg4-{line}"[^>]*>', dom).group()
        return "on" in re.search(r'class="([^"]*)"', tag).group(1).split()

    assert on(10) and on(21) and not on(7) and not on(24)
    assert on(12) == (kind == "p")
    # and at a step of the same CTA whose tile needs mask math
    kinds = [next(k for k, j0, j1 in facts["tile_map"][i] if j0 <= 5 < j1) for i in range(first, end)]
    step = 1 + kinds.index("p")
    dom, _ = dom_of(page.as_uri() + f"#cta=5&step={step}")
    assert f"CTA 5, step {step} of" in dom and "mask math (line 12)" in dom and on(12) and on(11)
    shot = tmp_path / "shot.png"
    subprocess.run([*base, "--window-size=1280,1600", f"--screenshot={shot}", url], capture_output=True, timeout=120)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_tile_reasons_name_the_family_cap_or_the_template_maximum() -> None:
    """A dimension at its default's ceiling says which: the template's maximum (the forward's 256 keys a
    step at d = 64), or the family's cap for the spec (the backward's 16 K/V rows per warp, the forward's
    128 keys at d = 128), never a shared-memory shrink that did not happen."""
    from fagen.explain.facts import tile_choice

    fwd64 = tile_choice(KernelSpec(direction="fwd", head_dim=64, dtype="float16", arch="sm_90"))["reasons"]
    assert fwd64["block_c"].startswith("B_c = 256: the mma template's maximum"), fwd64
    for kw in (dict(direction="bwd", head_dim=64), dict(direction="fwd", head_dim=128)):
        r = tile_choice(KernelSpec(dtype="float16", arch="sm_90", **kw))["reasons"]
        assert r["block_c"].startswith("B_c = 128: the mma family's cap for this spec"), (kw, r)
