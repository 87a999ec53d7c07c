#!/usr/bin/env bash
# Training prose for the GPU recipe (recipes/smollm2_gpu.yaml): the English reStructuredText sources of the Linux
# kernel documentation, from Debian's linux-doc-6.1 package (GPL-2.0), kept gzip-compressed as Debian ships them,
# under data/linux-doc-6.1/ (git-ignored). Needs apt-get (Debian or Ubuntu with the bookworm package); no root.
set -euo pipefail
cd "$(dirname "$0")/.."
target=data/linux-doc-6.1
if [ -d "$target" ]; then echo "$target exists"; exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -q linux-doc-6.1)
dpkg-deb -x "$work"/linux-doc-6.1_*.deb "$work/x"
docs="$work/x/usr/share/doc/linux-doc-6.1/Documentation"
mkdir -p "$work/out"
(cd "$docs" && find . -name '*.rst.gz' -not -path './translations/*' -print0 | tar --null -T - -cf -) \
    | tar -C "$work/out" -xf -
mkdir -p data && mv "$work/out" "$target"
echo "$target: $(find "$target" -name '*.rst.gz' | wc -l) files, $(du -sh "$target" | cut -f1)"
