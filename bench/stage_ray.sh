#!/usr/bin/env bash
# Stage Ray for the device machine's Python 3.12 (PYVER=3.11 builds one to try here) into
# .stage_ray/1, .stage_ray/2, ...: at most 22 MB each, one device call each beside the working
# tree, where the ray wheel alone is 79 MB. Ray is slimmed to its core, the dashboard's Python
# package and the runtime_env agent (no rllib, tune, train, data, serve, air, workflow, llm, Java
# jars, dashboard frontend, Cython headers, *.pyi; shared libraries and the raylet and GCS
# binaries stripped of symbols) and packed as tar.xz; beside it go the wheels Ray core and the
# cluster import (pyproject.toml). On the device machine, carry each part and run
# `bash .stage_ray/N/assemble`, in any order: each installs into /tmp/site what the machine's
# python3 cannot already import (its own versions win), and the one that completes the set
# starts a local Ray and runs an actor to check the whole.
set -euo pipefail
out=${1:-.stage_ray}
py=${PYVER:-3.12}
room=$((22000000 - 65536))  # bytes of packed files a part holds, beside assemble and manifest
mkdir -p "$out" && out=$(cd "$out" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
get() {  # pip download, CPython $py on manylinux x86_64, into $tmp/pack
  python3 -m pip download -q --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$tmp/pack" "$@"
}
# Health checking and reflection at 1.62: their generated code (protobuf 4.25, as tandem_proto's)
# runs on whatever protobuf from 4.25 on the machine has; later releases want protobuf >= 7.35.
get ray==2.60.0 grpcio==1.85.3 grpcio-health-checking==1.62.3 grpcio-reflection==1.62.3 \
  prometheus-client==0.26.0 aiohttp==3.14.5 jinja2==3.1.6
get --no-deps tokenizers==0.23.3  # its huggingface-hub comes with the machine's transformers

unzip -q "$tmp"/pack/ray-*.whl -d "$tmp/ray" && rm "$tmp"/pack/ray-*.whl
bins=(ray/_raylet.so ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet)
( cd "$tmp/ray/ray"
  rm -rf rllib tune train data serve air workflow llm jars dashboard/client includes \
    _raylet.pxd setup-dev.py
  find . \( -name __pycache__ -o -name tests \) -prune -exec rm -rf {} +
  find . \( -name '*.pyi' -o -name conftest.py \) -delete
  find . -name '*.so' -exec strip --strip-unneeded {} +
  strip --strip-unneeded core/src/ray/gcs/gcs_server core/src/ray/raylet/raylet )
# Each large binary is a piece of its own (the x86 filter packs machine code ~10% tighter), so
# the pieces can be spread over the parts; the rest of Ray is one more.
for b in "${bins[@]}"; do
  tar -C "$tmp/ray" -cf - "$b" | xz --x86 --lzma2=preset=9e \
    > "$tmp/pack/ray_$(basename "$b").tar.xz"
done
tar -C "$tmp/ray" "${bins[@]/#/--exclude=}" -cf - . | xz -9e > "$tmp/pack/ray_py.tar.xz"

# Largest first, each into the first part with room for it.
used=()
for f in $(ls -S "$tmp/pack"); do
  s=$(stat -c %s "$tmp/pack/$f") n=0
  [ "$s" -le "$room" ] || { echo "$f: $s bytes, more than a part holds" >&2; exit 1; }
  while [ "$n" -lt "${#used[@]}" ] && [ $((used[n] + s)) -gt "$room" ]; do n=$((n + 1)); done
  used[n]=$(( ${used[n]:-0} + s ))
  mkdir -p "$tmp/parts/$((n + 1))" && mv "$tmp/pack/$f" "$tmp/parts/$((n + 1))/"
done

# manifest: a line per file, its name and the modules it installs (all found: not needed).
modules() {
  case $1 in
    *.tar.xz) echo ray ;;  # a piece of Ray
    *) python3 - "$1" <<'EOP'
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = {n.split("/")[0] for n in names}
mods = set()
for t in tops - {t for t in tops if t.endswith((".dist-info", ".data"))}:
    if t in names:  # a module file at the top
        mods.add(t.split(".")[0])
    elif f"{t}/__init__.py" in names:
        mods.add(t)
    else:  # a namespace package (google): its packages
        mods |= {n.rsplit("/", 1)[0].replace("/", ".") for n in names
                 if n.startswith(t + "/") and n.count("/") == 2 and n.endswith("/__init__.py")}
print(" ".join(sorted(mods)))
EOP
    ;;
  esac
}
cat > "$tmp/assemble.in" <<'EOS'
#!/usr/bin/env bash
# Installs part @PART@ of @PARTS@ that bench/stage_ray.sh staged beside this file into /tmp/site:
# each file in `manifest` whose modules the machine's python3 cannot import apart from /tmp/site
# (wheels through pip, Ray's pieces unpacked). Once all @PARTS@ parts are in, imports every
# staged module, starts a local Ray and runs an actor, one with runtime_env env_vars.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
site=${SITE:-/tmp/site}  # SITE: another folder, to try it
python3 -c 'import sys; sys.exit(sys.version_info[:2] != (@PYT@))' ||
  { echo "these wheels are for Python @PY@, not $(python3 -V)" >&2; exit 1; }
mkdir -p "$site/.stage_ray"
need=$(python3 - "$here/manifest" "$site" <<'EOP'
import importlib.util
import os
import sys

site = os.path.realpath(sys.argv[2])
sys.path = [p for p in sys.path
            if os.path.commonpath([site, os.path.realpath(p or ".")]) != site]


def found(mod):
    try:
        return importlib.util.find_spec(mod) is not None
    except ImportError:  # its parent package is missing
        return False


for line in open(sys.argv[1]):
    name, *mods = line.split()
    if not all(found(m) for m in mods):
        print(name)
EOP
)
whls=()
for f in $need; do
  case $f in
    *.tar.xz) tar -xJf "$here/$f" -C "$site" ;;
    *) whls+=("$here/$f") ;;
  esac
done
[ ${#whls[@]} -eq 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
  --target "$site" "${whls[@]}"
names=$(for f in $need; do f=${f%.tar.xz}; echo "${f%%-[0-9]*}"; done)
echo "part @PART@/@PARTS@ into $site:" ${names:-nothing the machine lacks}
cp "$here/manifest" "$site/.stage_ray/@PART@"
for k in $(seq 1 @PARTS@); do
  [ -f "$site/.stage_ray/$k" ] || { echo "part $k still to assemble"; exit 0; }
done
tmpd=$(mktemp -d /tmp/rayXXXXXX)  # this check's own Ray session and logs
PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} RAY_USAGE_STATS_ENABLED=0 timeout 300 \
  python3 - "$tmpd" "$site/.stage_ray" <<'EOP' || { echo "check failed, logs: $tmpd" >&2; exit 1; }
import glob
import importlib
import os
import sys

mods = {m for f in glob.glob(sys.argv[2] + "/*") for line in open(f) for m in line.split()[1:]}
mods |= {"grpc_health.v1.health", "grpc_reflection.v1alpha.reflection"}  # protobuf gencode
for m in sorted(mods):
    importlib.import_module(m)
import ray

ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=sys.argv[1],
         log_to_driver=False)


@ray.remote
class Probe:
    def env(self, key):
        return os.environ.get(key)


plain = Probe.remote()
with_env = Probe.options(runtime_env={"env_vars": {"STAGE_RAY": "yes"}}).remote()
got = ray.get([plain.env.remote("STAGE_RAY"), with_env.env.remote("STAGE_RAY")], timeout=180)
ray.shutdown()
assert got == [None, "yes"], got
print(f"ray {ray.__version__} ({os.path.dirname(ray.__file__)}): {len(mods)} modules import, "
      "an actor ran, runtime_env env_vars reached another")
EOP
rm -rf "$tmpd"
EOS
parts=${#used[@]}
rm -rf "${out:?}"/[0-9]*
for d in "$tmp"/parts/*; do
  n=$(basename "$d")
  for f in $(ls "$d"); do m=$(modules "$d/$f"); echo "$f $m"; done > "$tmp/manifest"
  mv "$tmp/manifest" "$d/manifest"
  sed -e "s/@PART@/$n/g" -e "s/@PARTS@/$parts/g" -e "s/@PY@/$py/g" \
    -e "s/@PYT@/${py/./, }/g" "$tmp/assemble.in" > "$d/assemble"
  chmod +x "$d/assemble"
  mv "$d" "$out/$n"
done
du -sh "$out"/*
