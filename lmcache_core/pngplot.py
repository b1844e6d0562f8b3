"""A small line chart written as a PNG with the standard library only (``zlib``):
what ``lmcache-core replay --sweep`` draws, so the core needs no plotting package.

:func:`line_chart` draws curves of (x, y) points on linear or logarithmic x axes with
a grid, tick labels, a legend and horizontal reference lines; text uses a built-in
5x7 pixel font (upper-case letters, digits and a little punctuation; lower case is
drawn as upper case, anything else as ``?``). :func:`png_bytes` encodes any RGB
image (8 bits a channel, no interlace).
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field

RGB = tuple[int, int, int]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# 5 columns x 7 rows per glyph, rows top to bottom, '#' set
_FONT_ROWS = {
    " ": "..... ..... ..... ..... ..... ..... .....",
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ...#. .##..",
    "A": ".###. #...# #...# ##### #...# #...# #...#",
    "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.",
    "D": "####. #...# #...# #...# #...# #...# ####.",
    "E": "##### #.... #.... ####. #.... #.... #####",
    "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####",
    "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#",
    "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#",
    "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.",
    "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#",
    "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.",
    "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.",
    "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.",
    "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..",
    "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...",
    "-": "..... ..... ..... ##### ..... ..... .....",
    "_": "..... ..... ..... ..... ..... ..... #####",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "/": "..... ....# ...#. ..#.. .#... #.... .....",
    "=": "..... ..... ##### ..... ##### ..... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "?": ".###. #...# ....# ...#. ..#.. ..... ..#..",
    "'": "..#.. ..#.. .#... ..... ..... ..... .....",
}
FONT: dict[str, list[tuple[int, int]]] = {
    ch: [(x, y) for y, row in enumerate(rows.split()) for x, c in enumerate(row) if c == "#"] for ch, rows in _FONT_ROWS.items()
}
GLYPH_W, GLYPH_H = 5, 7

WHITE: RGB = (255, 255, 255)
BLACK: RGB = (0, 0, 0)
GRID: RGB = (225, 225, 225)
AXIS: RGB = (90, 90, 90)
#: curve colors, in order
PALETTE: tuple[RGB, ...] = (
    (31, 119, 180),
    (214, 39, 40),
    (44, 160, 44),
    (148, 103, 189),
    (255, 127, 14),
    (140, 86, 75),
    (227, 119, 194),
    (23, 190, 207),
)


def png_bytes(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """A PNG of ``width`` x ``height`` 8-bit RGB pixels, rows top to bottom."""
    if width <= 0 or height <= 0 or len(rgb) != width * height * 3:
        raise ValueError("png_bytes: the pixel data does not match the size")
    stride = width * 3
    raw = b"".join(b"\x00" + bytes(rgb[y * stride : (y + 1) * stride]) for y in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


class Canvas:
    """An RGB raster with clipped drawing primitives."""

    def __init__(self, width: int, height: int, background: RGB = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def point(self, x: int, y: int, color: RGB) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i : i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: RGB) -> None:
        """Fill the rectangle with corners (x0, y0) and (x1, y1), both included."""
        x0, x1 = max(0, min(x0, x1)), min(self.width - 1, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height - 1, max(y0, y1))
        if x0 > x1 or y0 > y1:
            return
        row = bytes(color) * (x1 - x0 + 1)
        for y in range(y0, y1 + 1):
            i = (y * self.width + x0) * 3
            self.pixels[i : i + len(row)] = row

    def line(self, x0: float, y0: float, x1: float, y1: float, color: RGB, width: int = 1, dash: int = 0) -> None:
        """A straight line ``width`` pixels thick; ``dash``: on/off length in pixels."""
        steps = max(1, int(math.ceil(max(abs(x1 - x0), abs(y1 - y0)))))
        lo = -(width // 2)
        for s in range(steps + 1):
            if dash and (s // dash) % 2:
                continue
            x = round(x0 + (x1 - x0) * s / steps)
            y = round(y0 + (y1 - y0) * s / steps)
            self.rect(x + lo, y + lo, x + lo + width - 1, y + lo + width - 1, color)

    def text(self, x: int, y: int, text: str, color: RGB = BLACK, scale: int = 2) -> int:
        """Draw ``text`` with its top-left corner at (x, y); returns its width."""
        cx = x
        for ch in text:
            glyph = FONT.get(ch)
            if glyph is None:
                glyph = FONT.get(ch.upper(), FONT["?"])
            for gx, gy in glyph:
                self.rect(cx + gx * scale, y + gy * scale, cx + gx * scale + scale - 1, y + gy * scale + scale - 1, color)
            cx += (GLYPH_W + 1) * scale
        return cx - x

    def png(self) -> bytes:
        return png_bytes(self.width, self.height, self.pixels)


def text_width(text: str, scale: int = 2) -> int:
    return len(text) * (GLYPH_W + 1) * scale


@dataclass
class Series:
    label: str
    points: list[tuple[float, float]]
    color: RGB | None = None
    dash: int = 0


@dataclass
class Chart:
    title: str
    x_label: str
    y_label: str
    series: list[Series] = field(default_factory=list)
    #: horizontal reference lines: (y, label)
    hlines: list[tuple[float, str]] = field(default_factory=list)
    log_x: bool = False
    #: tick labels: value -> text
    x_format: str = "{:g}"
    y_format: str = "{:g}"


def _nice_step(span: float, ticks: int) -> float:
    raw = span / max(ticks, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def _log_ticks(lo: float, hi: float) -> list[float]:
    out = []
    for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1):
        for m in (1, 2, 5):
            v = m * 10.0**e
            if lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9):
                out.append(v)
    return out


@dataclass(frozen=True)
class _Plot:
    """The plot area of a chart (pixels) and its data ranges: maps data to pixels."""

    left: int
    top: int
    pw: int
    ph: int
    x_lo: float
    x_hi: float
    y_hi: float
    y_step: float
    log_x: bool

    def px(self, x: float) -> float:
        if self.log_x:
            return self.left + self.pw * (math.log(x) - math.log(self.x_lo)) / (math.log(self.x_hi) - math.log(self.x_lo))
        return self.left + self.pw * (x - self.x_lo) / (self.x_hi - self.x_lo)

    def py(self, y: float) -> float:
        return self.top + self.ph - self.ph * y / self.y_hi


def _plot_area(chart: Chart, width: int, height: int) -> _Plot:
    left, right, top, bottom = 90, 30, 70, 70
    xs = [x for s in chart.series for x, _ in s.points]
    ys = [y for s in chart.series for _, y in s.points] + [y for y, _ in chart.hlines]
    if not xs:
        raise ValueError("line_chart: nothing to draw")
    x_lo, x_hi = min(xs), max(xs)
    log_x = chart.log_x and x_lo > 0
    if log_x:
        x_lo, x_hi = x_lo / 1.15, x_hi * 1.15
    else:
        x_lo = 0.0
        x_hi = x_hi if x_hi > 0 else 1.0
    y_step = _nice_step(max(max(ys), 1e-9), 6)
    y_hi = max(y_step, math.ceil(max(ys) * 1.05 / y_step) * y_step)
    return _Plot(left, top, width - left - right, height - top - bottom, x_lo, x_hi, y_hi, y_step, log_x)


def line_chart(chart: Chart, width: int = 960, height: int = 600) -> bytes:
    """The chart as PNG bytes."""
    c = Canvas(width, height)
    p = _plot_area(chart, width, height)
    _draw_axes(c, chart, p)
    _draw_series(c, chart, p)
    _draw_legend(c, chart, p)
    c.text(p.left, 18, chart.title, BLACK)
    c.text(p.left, 44, chart.y_label, AXIS)
    c.text(p.left + p.pw // 2 - text_width(chart.x_label) // 2, height - 30, chart.x_label, AXIS)
    return c.png()


def _draw_axes(c: Canvas, chart: Chart, p: _Plot) -> None:
    """Grid, tick labels, the two axes and the reference lines."""
    left, top, pw, ph = p.left, p.top, p.pw, p.ph
    x_ticks = _log_ticks(p.x_lo, p.x_hi) if p.log_x else [i * _nice_step(p.x_hi, 8) for i in range(0, 9)]
    for v in x_ticks:
        if not (p.x_lo <= v <= p.x_hi * (1 + 1e-9)):
            continue
        x = round(p.px(v))
        c.line(x, top, x, top + ph, GRID)
        label = chart.x_format.format(v)
        c.text(x - text_width(label) // 2, top + ph + 10, label, AXIS)
    n_y = int(round(p.y_hi / p.y_step))
    for i in range(n_y + 1):
        v = i * p.y_step
        y = round(p.py(v))
        c.line(left, y, left + pw, y, GRID)
        label = chart.y_format.format(v)
        c.text(left - 10 - text_width(label), y - GLYPH_H, label, AXIS)
    c.line(left, top, left, top + ph, AXIS, 2)
    c.line(left, top + ph, left + pw, top + ph, AXIS, 2)
    for y_val, label in chart.hlines:
        y = round(p.py(y_val))
        c.line(left, y, left + pw, y, AXIS, 1, dash=3)
        c.text(left + 8, y - 2 * GLYPH_H - 6, label, AXIS)


def _draw_series(c: Canvas, chart: Chart, p: _Plot) -> None:
    """Each series as a line through its points, each point a small square."""
    for k, s in enumerate(chart.series):
        color = s.color or PALETTE[k % len(PALETTE)]
        pts = sorted(s.points)
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            c.line(p.px(x0), p.py(y0), p.px(x1), p.py(y1), color, 3, dash=s.dash)
        for vx, vy in pts:
            mx, my = round(p.px(vx)), round(p.py(vy))
            c.rect(mx - 3, my - 3, mx + 3, my + 3, color)


def _draw_legend(c: Canvas, chart: Chart, p: _Plot) -> None:
    """The legend, in the lower right corner inside the plot."""
    rows = len(chart.series)
    lw = max((text_width(s.label) for s in chart.series), default=0) + 60
    lx, ly = p.left + p.pw - lw - 10, p.top + p.ph - rows * 24 - 16
    c.rect(lx, ly, lx + lw, ly + rows * 24 + 8, WHITE)
    for k, s in enumerate(chart.series):
        color = s.color or PALETTE[k % len(PALETTE)]
        y = ly + 10 + k * 24
        c.line(lx + 8, y + GLYPH_H, lx + 40, y + GLYPH_H, color, 3, dash=s.dash)
        c.text(lx + 50, y, s.label, BLACK)


def check_png(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG this module writes; ValueError if it is not one
    (signature, chunk CRCs, IHDR first, IEND last, the pixel data's length)."""
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG: bad signature")
    pos, chunks = len(PNG_SIGNATURE), []
    while pos < len(data):
        if pos + 8 > len(data):
            raise ValueError("truncated chunk header")
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        tag = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + n]
        crc = data[pos + 8 + n : pos + 12 + n]
        if len(body) != n or len(crc) != 4 or struct.unpack(">I", crc)[0] != zlib.crc32(tag + body) & 0xFFFFFFFF:
            raise ValueError(f"chunk {tag!r}: bad length or CRC")
        chunks.append((tag, body))
        pos += 12 + n
    if not chunks or chunks[0][0] != b"IHDR" or chunks[-1][0] != b"IEND":
        raise ValueError("IHDR must come first and IEND last")
    w, h, depth, ctype, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
    if depth != 8 or ctype != 2:
        raise ValueError("not 8-bit RGB")
    raw = zlib.decompress(b"".join(b for t, b in chunks if t == b"IDAT"))
    if len(raw) != h * (1 + 3 * w):
        raise ValueError("pixel data does not match IHDR")
    return w, h
