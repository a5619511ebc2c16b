"""Instructions per iteration of the wgmma prefill kernel's main loop, from `cuobjdump
--dump-sass` text: the loop is the longest backward branch; the common path leaves out the
regions that forward branches skip when softcap is off and the block needs no mask (their code
holds MUFU.RCP or an FSEL with -INF). Static counts, not a profile.

    nvcc -O3 -std=c++17 -I. -DJKV_CUDA_TYPES -DJKV_PREFILL_ALL_CONFIGS \\
        --generate-code=arch=compute_90a,code=sm_90a -c cuda/gqa_prefill_wgmma.cu -o /tmp/p.o
    cuobjdump --dump-sass /tmp/p.o > /tmp/p.sass   # PyPI's nvidia-cuda-cuobjdump has one
    python bench/sass_prefill_loop.py /tmp/p.sass --match bfloat16Li128ELi2ELi128ELb0
"""

from __future__ import annotations

import argparse
import collections
import re

INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
BRANCH = re.compile(r"BRA\s+(?:!?P\d,\s*)?0x([0-9a-f]+)")
GUARDED = re.compile(r"@!?P\d\s+BRA\s+(?:!?P\d,\s*)?0x([0-9a-f]+)")


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main_loop(instrs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    index = {a: i for i, (a, _) in enumerate(instrs)}
    loops = []
    for i, (a, t) in enumerate(instrs):
        m = BRANCH.search(t)
        if m and int(m.group(1), 16) < a:
            target = int(m.group(1), 16)
            loops.append((i - index[target], target, a))
    _, lo, hi = max(loops)
    return [(a, t) for a, t in instrs if lo <= a <= hi]


def common_path(body: list[tuple[int, str]]) -> list[tuple[int, str]]:
    skipped = set()
    for a, t in body:
        m = GUARDED.match(t)
        if not m or int(m.group(1), 16) <= a:
            continue
        region = [x for x in body if a < x[0] < int(m.group(1), 16)]
        text = " ".join(x[1] for x in region)
        if ("RCP" in text or "-INF" in text) and "HGMMA" not in text:
            skipped.update(x[0] for x in region)
    return [(a, t) for a, t in body if a not in skipped]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sass")
    ap.add_argument("--match", action="append", required=True, help="substring of the name")
    args = ap.parse_args()
    for func in re.split(r"\n\s*Function : ", open(args.sass).read())[1:]:
        name = func.split("\n")[0]
        if not any(m in name for m in args.match):
            continue
        instrs = [
            (int(m.group(1), 16), m.group(2).strip())
            for m in map(INSTR.match, func.split("\n"))
            if m
        ]
        body = main_loop(instrs)
        common = common_path(body)
        counts = collections.Counter(opcode(t) for _, t in common)
        print(f"{name}\n  loop: {len(body)} static, {len(common)} on the common path")
        print("  " + ", ".join(f"{k} {v}" for k, v in counts.most_common(16)))


if __name__ == "__main__":
    main()
