"""The loss curve as a PNG with no plotting library: training loss (blue, a point
per logged step) and held-out loss (red, a point per evaluation) against tokens
seen, on a grid of one nat a line (y) and a tenth of the run a line (x). Written
with zlib and struct, as the PNG specification lays a file out."""
import struct
import zlib

WIDTH, HEIGHT, MARGIN = 800, 480, 40
BLUE, RED, GRID, AXIS = (40, 90, 200), (210, 40, 40), (225, 225, 225), (0, 0, 0)


def _chunk(kind, data):
    return (struct.pack(">I", len(data)) + kind + data +
            struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff))


def write(path, train, held_out, y_max):
    """train, held_out: [(tokens seen, loss in nats)]; y from 0 to y_max nats."""
    pixels = [[(255, 255, 255)] * WIDTH for _ in range(HEIGHT)]
    x_max = max(t for t, _ in train + held_out)
    w, h = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN

    def at(tokens, loss):
        x = MARGIN + round(tokens / x_max * w)
        y = HEIGHT - MARGIN - round(min(loss, y_max) / y_max * h)
        return x, y

    def dot(x, y, color, r):
        for dy in range(-r, r + 1):
            for dx in range(-r, r + 1):
                if 0 <= y + dy < HEIGHT and 0 <= x + dx < WIDTH:
                    pixels[y + dy][x + dx] = color

    def line(p, q, color, r):
        steps = max(abs(q[0] - p[0]), abs(q[1] - p[1]), 1)
        for s in range(steps + 1):
            dot(round(p[0] + (q[0] - p[0]) * s / steps), round(p[1] + (q[1] - p[1]) * s / steps),
                color, r)

    for nat in range(1, int(y_max) + 1):
        line(at(0, nat), at(x_max, nat), GRID, 0)
    for tenth in range(1, 11):
        line(at(x_max * tenth / 10, 0), at(x_max * tenth / 10, y_max), GRID, 0)
    line(at(0, 0), at(x_max, 0), AXIS, 0)
    line(at(0, 0), at(0, y_max), AXIS, 0)
    for points, color, r in ((train, BLUE, 0), (held_out, RED, 1)):
        coords = [at(t, loss) for t, loss in points]
        for p, q in zip(coords, coords[1:]):
            line(p, q, color, r)
        for p in coords:
            dot(*p, color, r + 1)
    raw = b"".join(b"\0" + bytes(v for px in row for v in px) for row in pixels)
    png = (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", WIDTH, HEIGHT, 8, 2, 0, 0, 0)) +
           _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)
