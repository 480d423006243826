"""Size the library notebooks' export cells for reading, without changing the code they export.

    python tools/tidy_cells.py nbs/report/32_tables.ipynb ...   # or no argument: every library notebook

1. An export cell that holds several top-level functions or classes is split into one cell per function or class
   (decorators and the comments just above a definition go with it; consecutive plain statements stay together).
2. A line longer than 120 characters is re-wrapped by black (line length 120, strings as written), only that line's
   statement, and only where that costs at most GROWTH extra lines; a one-line docstring too long for one line becomes a wrapped triple-quoted one, and a trailing comment
   that makes a line too long moves onto its own line above the statement.

The exported module's syntax tree is compared before and after (string constants compared with their whitespace
collapsed): the tool refuses to write a notebook whose code would change.
"""
import ast, json, re, sys, textwrap, uuid
from pathlib import Path

import black

MAX = 120
MODE = black.Mode(line_length=MAX, string_normalization=False, magic_trailing_comma=False,
                  enabled_features={black.Preview.string_processing})  # long strings split into implicit concatenations
DIRECTIVE = re.compile(r'^\s*#\|')
GROWTH = 2  # a statement black would spread over more extra lines than this keeps its long line (modules stay short)


def src(c): return ''.join(c['source']) if isinstance(c['source'], list) else c['source']
def is_export(c): return c['cell_type'] == 'code' and any(re.match(r'#\|\s*export\s*$', l) for l in src(c).splitlines())


def split_code(code: str) -> list[str]:
    "`code` cut at top-level definitions: [chunk, ...], each def/class (with decorators and comments above) alone."
    lines = code.split('\n')
    try: tree = ast.parse(code)
    except SyntaxError: return [code]
    starts = []  # (first line index, is a definition)
    for node in tree.body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, 'decorator_list', [])]) - 1
        while first > 0 and lines[first - 1].lstrip().startswith('#') and not DIRECTIVE.match(lines[first - 1]):
            first -= 1  # comments right above belong to the statement
        starts.append((first, isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))))
    if sum(d for _, d in starts) < 2 and len(starts) < 2: return [code]
    chunks, cur_start, cur_def = [], 0, None
    for i, (first, is_def) in enumerate(starts):
        if i == 0: cur_start, cur_def = 0, is_def; continue
        if is_def or cur_def:  # a definition starts, or the current chunk was one: cut here
            chunks.append('\n'.join(lines[cur_start:first]).strip('\n')); cur_start, cur_def = first, is_def
    chunks.append('\n'.join(lines[cur_start:]).strip('\n'))
    return [c for c in chunks if c.strip()]


def _docstring_fix(code: str) -> str:
    "One-line docstrings longer than MAX as wrapped triple-quoted docstrings."
    out = []
    for line in code.split('\n'):
        m = re.match(r'^(\s*)"((?:[^"\\]|\\.)*)"\s*$', line)
        prev = next((l.strip() for l in reversed(out) if l.strip()), '')
        after_def = prev.endswith(':') and prev.startswith(('def ', 'class ', 'async def ')) or prev.endswith(('):', ') -> None:'))
        if len(line) > MAX and m and '"""' not in line and after_def:  # a docstring: whitespace in it is free
            ind, text = m.group(1), m.group(2)
            body = textwrap.wrap(text, MAX - len(ind) - 3, break_on_hyphens=False, break_long_words=False)
            out.append(f'{ind}"""{body[0]}')
            out += [f'{ind}{b}' for b in body[1:-1]] if len(body) > 2 else []
            if len(body) > 1: out.append(f'{ind}{body[-1]}"""')
            else: out[-1] += '"""'
        else: out.append(line)
    return '\n'.join(out)


def _comment_fix(code: str) -> str:
    "A trailing comment that makes a line too long goes on its own line(s) above the line."
    import io, tokenize
    try: toks = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError): return code
    lines = code.split('\n')
    moves = {}
    for t in toks:
        if t.type == tokenize.COMMENT:
            row, col = t.start
            line = lines[row - 1]
            if len(line) > MAX and line[:col].strip() and not DIRECTIVE.match(line):
                moves[row - 1] = col
    for i in sorted(moves, reverse=True):
        line, col = lines[i], moves[i]
        code_part, comment = line[:col].rstrip(), line[col:].lstrip('#').strip()
        if code_part.rstrip().endswith((',', '(')) and re.match(r'^\s+\w+\s*[:=,]', code_part): continue  # a docments argument
        ind = re.match(r'\s*', line).group(0)
        wrapped = textwrap.wrap(comment, MAX - len(ind) - 2, break_on_hyphens=False)
        lines[i:i + 1] = [f'{ind}# {w}' for w in wrapped] + [code_part]
    return '\n'.join(lines)


def _spans(code: str, i: int) -> list[tuple[int, int]]:
    "The statements around line `i`, smallest first (black may fail on one and manage its parent)."
    try: tree = ast.parse(code)
    except SyntaxError: return []
    around = sorted({(n.end_lineno - n.lineno, n.lineno, n.end_lineno) for n in ast.walk(tree)
                     if isinstance(n, ast.stmt) and n.lineno <= i <= n.end_lineno})
    return [(a, b) for _, a, b in around]


def wrap_long(code: str) -> str:
    "Re-wrap, one at a time, the smallest statement around each line longer than MAX (black, only that statement)."
    code, failed = _docstring_fix(_comment_fix(code)), set()
    while True:
        lines = code.split('\n')
        todo = [i + 1 for i, l in enumerate(lines) if len(l) > MAX and l not in failed]
        if not todo: return code
        i = todo[0]
        for span in _spans(code, i)[:3]:
            try: new = black.format_str(code, mode=MODE, lines=[span]).rstrip('\n')
            except Exception: continue
            if new != code and len(new.split('\n')) - len(lines) <= GROWTH and _same(code, new): code = new; break
        else: failed.add(lines[i - 1])
        if code.split('\n') == lines: failed.add(lines[i - 1])


def _norm(tree):
    "ast dump with string constants' whitespace collapsed (docstrings re-wrapped read the same)."
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str): n.value = ' '.join(n.value.split())
    return ast.dump(tree, include_attributes=False)


def _same(a: str, b: str) -> bool:
    "Whether two pieces of code have the same syntax tree (string whitespace aside)."
    try: return _norm(ast.parse(a)) == _norm(ast.parse(b))
    except SyntaxError: return False


def exported_code(cells) -> str:
    return '\n\n'.join('\n'.join(l for l in src(c).split('\n') if not DIRECTIVE.match(l)) for c in cells if is_export(c))


def tidy(path: Path) -> tuple[int, int]:
    nb = json.loads(path.read_text())
    before = exported_code(nb['cells'])
    cells = []
    for c in nb['cells']:
        if not is_export(c): cells.append(c); continue
        s = src(c); lines = s.split('\n')
        head = [l for l in lines if DIRECTIVE.match(l)]
        code = '\n'.join(l for l in lines if not DIRECTIVE.match(l))
        chunks = split_code(code)
        for k, chunk in enumerate(chunks):
            chunk = wrap_long(chunk)
            new = dict(c) if k == 0 else {'cell_type': 'code', 'execution_count': None, 'id': uuid.uuid4().hex[:8],
                                          'metadata': {}, 'outputs': []}
            new['source'] = '\n'.join(head + [chunk])
            if k: new['outputs'] = []
            cells.append(new)
    after = exported_code(cells)
    if _norm(ast.parse(before)) != _norm(ast.parse(after)):
        raise SystemExit(f'{path}: the exported code would change; nothing written')
    n_before = sum(is_export(c) for c in nb['cells'])
    nb['cells'] = cells
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')
    return n_before, sum(is_export(c) for c in cells)


if __name__ == '__main__':
    root = Path(__file__).resolve().parent.parent
    paths = [Path(p) for p in sys.argv[1:]] or sorted((root / 'nbs').rglob('[0-9]*.ipynb'))
    for p in paths:
        a, b = tidy(p)
        print(f'[tidy] {p.name}: {a} -> {b} export cells')
