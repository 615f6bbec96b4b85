#!/usr/bin/env bash
# Stage UCX (ucxx and its libraries, for the device machine's Python 3.12) into
# .stage_ucx/one: ~21 MB, one device call beside the working tree, where the libucx-cu13
# wheel alone is 42 MB. libucx is slimmed (no static libraries, perftest or tools; the
# copies of each shared library under its three names become hard links) and packed as
# tar.xz; the other wheels go as they are. On the device machine, carry `.stage_ucx/one`
# and run `bash .stage_ucx/one/assemble` (installs into /tmp/site).
set -euo pipefail
out=${1:-.stage_ucx/one}
mkdir -p "$out" && out=$(cd "$out" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp/whl" \
  ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 'libucx-cu13<1.22' rmm-cu13 librmm-cu13 rapids-logger
mkdir -p "$tmp/x" "$out"
rm -f "$out"/*.whl "$out"/libucx_slim.tar.xz
unzip -q "$tmp"/whl/libucx_cu13-*.whl -d "$tmp/x"
rm "$tmp"/whl/libucx_cu13-*.whl
( cd "$tmp/x"
  find . -name '*.a' -delete
  rm -rf libucx/bin libucx/share/ucx/perftest
  find . -name '*perftest*' -delete
  for f in $(find libucx/lib -name '*.so.0.0.0'); do
    ln -f "$f" "${f%.0.0}"; ln -f "$f" "${f%.0.0.0}"
  done
  tar -cJf "$out/libucx_slim.tar.xz" . )
cp "$tmp"/whl/*.whl "$out/"
cat > "$out/assemble" <<'EOS'
#!/usr/bin/env bash
# Installs what bench/stage_ucx.sh staged beside this file into /tmp/site.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/site
tar -xJf "$here/libucx_slim.tar.xz" -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$here"/*.whl
echo "wheels: /tmp/site (export PYTHONPATH=/tmp/site)"
EOS
chmod +x "$out/assemble"
du -sh "$out"
