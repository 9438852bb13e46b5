#!/usr/bin/env bash
# Fetches real photographs for demos, benchmarks and preprocessing golden files: Debian's
# mate-backgrounds package (JPEG/PNG wallpapers up to 5640x3172), downloaded with apt-get and
# unpacked into data/photos/ (ignored by git: the photos are never committed).
#   tools/fetch-photos.sh            -> prints the folder
set -euo pipefail
cd "$(dirname "$0")/.."
dest=data/photos
if [ -n "$(ls "$dest"/*.jpg 2>/dev/null | head -1)" ]; then echo "$dest"; exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download mate-backgrounds >/dev/null 2>&1) ||
  { echo "fetch-photos: apt-get download mate-backgrounds failed (offline?)" >&2; exit 1; }
dpkg-deb -x "$tmp"/mate-backgrounds_*.deb "$tmp/x"
mkdir -p "$dest"
find "$tmp/x" -type f \( -name '*.jpg' -o -name '*.png' \) -exec cp {} "$dest/" \;
echo "$dest"
