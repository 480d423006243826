"""Refactors change no number: run each study's smoke batch (`Study.smoke`, seed 0, pinned float32) and record or compare
the runs' summaries.

    python tools/same_numbers.py record OUT.json [--work DIR]   # before a refactor
    python tools/same_numbers.py compare OUT.json [--work DIR]  # after it: every number within 1e-6 (relative), or exit 1

Every numeric field of every run's summary.json is compared; timings, paths and dates are left out (they differ by nature).
"""
import argparse, json, math, shutil, subprocess, sys, tempfile
from pathlib import Path

SMALL = ['--set', 'train.dtype=float32', '--seeds', '0', '--no-report', '--jobs', '1']


def smoke_args(study) -> list[str]:
    "The command-line arguments of a study's smoke batch (`Study.smoke` on the small corpus)."
    from oelm_nb.lab.study import SMALL_CORPUS
    sm = study.smoke
    args = ['--preset', 'tiny', '--steps', str(sm.get('steps', 30))]
    for k, v in sm.get('options', {}).items(): args += ['--' + k.replace('_', '-'), json.dumps(v)]  # one options field
    if sm.get('variants'): args += ['--variants', ','.join(sm['variants'])]
    for k, v in {**SMALL_CORPUS, **sm.get('overrides', {})}.items(): args += ['--set', f'{k}={json.dumps(v)}']
    return args


def batches() -> dict[str, list[str]]:
    "study -> the arguments of its smoke batch, for every study that declares one (the same batches the docs run)."
    from oelm_nb.lab.study import studies
    return {name: smoke_args(st) for name, st in studies().items() if st.smoke}


# words in a key that mark a number that differs by nature between two identical runs
VOLATILE = ('time', 'second', 'elapsed', 'date', 'started', 'finished', 'tok_per', 'tokens_per', 'per_s', 'pid', 'host',
            'mem', 'commit', 'version', 'duration', 'wall', 'mfu', 'throughput', 'ms', 'speedup')


def volatile(key: str) -> bool:
    "A field that differs by nature between two identical runs: a timing, a date, a host, a version."
    k = key.lower()
    return any(w in k for w in VOLATILE) or k.endswith('_s') or '_s.' in k


def numbers(obj, prefix=''):
    "Flatten a summary into {dotted.key: number}, leaving out volatile fields."
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items(): out.update(numbers(v, f'{prefix}{k}.'))
    elif isinstance(obj, list):
        for i, v in enumerate(obj): out.update(numbers(v, f'{prefix}{i}.'))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        key = prefix[:-1]
        if not volatile(key): out[key] = float(obj)
    return out


def run_all(work: Path, plan: dict[str, list[str]]):
    oelm = str(Path(sys.executable).with_name('oelm'))
    result = {}
    for study, args in plan.items():
        out = work / study
        shutil.rmtree(out, ignore_errors=True)
        cmd = [oelm, 'run', study, *args, *SMALL, '--out', str(out)]
        print('[same-numbers]', ' '.join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        for s in sorted(out.glob('*/summary.json')):
            result[f'{study}/{s.parent.name}'] = numbers(json.loads(s.read_text()))
    return result


def compare(before, after, tol=1e-6):
    bad = []
    for run in sorted(set(before) | set(after)):
        b, a = before.get(run), after.get(run)
        b = b and {k: v for k, v in b.items() if not volatile(k)}
        a = a and {k: v for k, v in a.items() if not volatile(k)}
        if b is None or a is None:
            bad.append(f'{run}: only {"after" if b is None else "before"}'); continue
        for k in sorted(set(b) & set(a)):
            x, y = b[k], a[k]
            if not (math.isclose(x, y, rel_tol=tol, abs_tol=tol) or (math.isnan(x) and math.isnan(y))):
                bad.append(f'{run}: {k} {x!r} -> {y!r}')
        gone = sorted(set(b) - set(a))
        if gone: bad.append(f'{run}: fields gone: {gone}')
    return bad


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('mode', choices=['record', 'compare'])
    p.add_argument('file', type=Path)
    p.add_argument('--work', type=Path, default=None, help='where the batches go (default: a temporary folder)')
    a = p.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix='same-numbers-'))
    rec = json.loads(a.file.read_text()) if a.mode == 'compare' else {}
    if a.mode == 'compare' and '_batches' not in rec:  # today's batches would compare other runs than the record's
        sys.exit(f'{a.file} records no batches (an older tool wrote it): compare with the tool that recorded it, or '
                 'record again before the change')
    plan = rec.pop('_batches', None) or batches()  # compare runs exactly the batches recorded
    now = run_all(work, plan)
    if a.mode == 'record':
        a.file.write_text(json.dumps({'_batches': plan, **now}, indent=1, sort_keys=True))
        print(f'[same-numbers] {sum(map(len, now.values()))} numbers from {len(now)} runs -> {a.file}')
    else:
        bad = compare(rec, now)
        n = sum(map(len, now.values()))
        print(f'[same-numbers] {n} numbers from {len(now)} runs compared with {a.file}: '
              + ('identical to 1e-6' if not bad else f'{len(bad)} differ'))
        for line in bad[:50]: print('  ', line)
        if len(bad) > 50:
            runs = sorted({line.split(':')[0] for line in bad})
            print(f'   ... and {len(bad) - 50} more; runs that differ: {", ".join(runs)}')
        sys.exit(1 if bad else 0)
