"""The package's size rules, measured: export cells at most 60 lines (median at most 12), library lines at most 120
characters. Modules have no cap: size follows the concern.

    python tools/check_structure.py            # every module and notebook; exit 1 when a rule is broken
    python tools/check_structure.py nbs/train/42_trainer.ipynb ...   # only these notebooks (and their modules)
"""
import json, re, statistics, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_CELL, MEDIAN_CELL, MAX_LINE = 60, 12, 120  # no cap on a module: size follows its concern


def export_cells(nb: Path) -> list[list[str]]:
    "The code lines of each `#| export` cell of notebook `nb` (directive lines left out)."
    cells = json.loads(nb.read_text())['cells']
    out = []
    for c in cells:
        s = ''.join(c['source']) if isinstance(c['source'], list) else c['source']
        lines = s.splitlines()
        if c['cell_type'] == 'code' and any(re.match(r'#\|\s*export', l) for l in lines):
            out.append([l for l in lines if not l.startswith('#|')])
    return out


def module_of(nb: Path) -> Path | None:
    m = re.search(r'#\|\s*default_exp\s+([\w.]+)', nb.read_text())
    return ROOT / 'oelm_nb' / (m.group(1).replace('.', '/') + '.py') if m else None


def problems(notebooks: list[Path]) -> tuple[list[str], list[int]]:
    bad, sizes = [], []
    for nb in notebooks:
        mod = module_of(nb)
        if mod is None: continue
        cells = export_cells(nb)
        sizes += [len(c) for c in cells]
        for c in cells:
            if len(c) > MAX_CELL: bad.append(f'{nb.name}: an export cell of {len(c)} lines (max {MAX_CELL}): {c[0][:60]!r}')
        if mod.exists():
            lines = mod.read_text().splitlines()
            in_all = False  # nbdev writes the __all__ list itself (a few characters over 120): not ours to wrap
            for i, l in enumerate(lines, 1):
                in_all = l.startswith('__all__ = [') or (in_all and l.startswith(' '))
                if len(l) > MAX_LINE and not in_all: bad.append(f'{mod.name}:{i}: {len(l)} characters (max {MAX_LINE})')
    return bad, sizes


if __name__ == '__main__':
    nbs = [Path(a).resolve() for a in sys.argv[1:]] or sorted((ROOT / 'nbs').rglob('[0-9]*.ipynb'))
    bad, sizes = problems(nbs)
    for b in bad: print(b)
    med = statistics.median(sizes) if sizes else 0
    print(f'[structure] {len(sizes)} export cells, median {med:g} lines (max {MEDIAN_CELL}), largest {max(sizes, default=0)}; '
          f'{len(bad)} problem(s)')
    if med > MEDIAN_CELL and len(sys.argv) == 1: print(f'[structure] median export cell {med:g} lines > {MEDIAN_CELL}')
    sys.exit(1 if bad or (len(sys.argv) == 1 and med > MEDIAN_CELL) else 0)
