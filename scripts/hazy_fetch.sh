#!/usr/bin/env bash
# Lays out the third-party sources that scripts/hazy_compare.sh builds, in the ignored folder .thirdparty/
# (never committed, never shipped): HazyResearch/Megakernels and its ThunderKittens submodule, at pinned commits,
# exported from bare git mirrors. Runs on the development machine, from the repository root:
#
#   bash scripts/hazy_fetch.sh [MEGAKERNELS_GIT_DIR [THUNDERKITTENS_GIT_DIR]]
#
# The mirrors come from the session's `fetch` tool (github:HazyResearch/Megakernels and
# github:HazyResearch/ThunderKittens), which leaves bare git directories under /work/.mirror (the defaults below);
# anywhere else, a `git clone --bare` of each repository does the same. Only what the low-latency-llama demo needs is
# kept (its .cu sources, the two include trees, the Python package, the licenses): about 1.5 MB, well inside what the
# GPU machine receives as carried files. Set HAZY_MK_COMMIT / HAZY_TK_COMMIT to pin other commits.
set -euo pipefail
cd "$(dirname "$0")/.."

MK_GIT=${1:-/work/.mirror/HazyResearch+Megakernels/repo}
TK_GIT=${2:-/work/.mirror/HazyResearch+ThunderKittens/repo}
MK_COMMIT=${HAZY_MK_COMMIT:-7309cec}
TK_COMMIT=${HAZY_TK_COMMIT:-664c108}
DEST=.thirdparty

die() { echo "hazy_fetch: $*" >&2; exit 1; }

for pair in "Megakernels:$MK_GIT:$MK_COMMIT" "ThunderKittens:$TK_GIT:$TK_COMMIT"; do
  IFS=: read -r name dir commit <<<"$pair"
  [[ -d $dir ]] || die "no git directory for $name at $dir (fetch github:HazyResearch/$name first, or pass its path)"
  git --git-dir="$dir" cat-file -e "$commit^{commit}" 2>/dev/null \
    || die "$name's git directory $dir has no commit $commit"
done

# the submodule commit Megakernels pins must be the ThunderKittens commit we export
pinned=$(git --git-dir="$MK_GIT" ls-tree "$MK_COMMIT" ThunderKittens | awk '{print $3}')
tk_full=$(git --git-dir="$TK_GIT" rev-parse "$TK_COMMIT^{commit}")
[[ $pinned == "$tk_full" ]] || die "Megakernels $MK_COMMIT pins ThunderKittens $pinned, not $tk_full"

rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp/Megakernels/ThunderKittens"
git --git-dir="$MK_GIT" archive "$MK_COMMIT" LICENSE demos/low-latency-llama include megakernels \
  | tar -x -C "$DEST.tmp/Megakernels"
rm -rf "$DEST.tmp/Megakernels/megakernels/scripts"  # their command-line scripts: not used here
git --git-dir="$TK_GIT" archive "$TK_COMMIT" LICENSE include | tar -x -C "$DEST.tmp/Megakernels/ThunderKittens"

for need in demos/low-latency-llama/llama.cu include/megakernel.cuh megakernels/demos/latency/scheduler.py \
            ThunderKittens/include/kittens.cuh ThunderKittens/include/pyutils/pyutils.cuh; do
  [[ -e $DEST.tmp/Megakernels/$need ]] || die "exported tree lacks $need"
done
{
  echo "Megakernels $(git --git-dir="$MK_GIT" rev-parse "$MK_COMMIT^{commit}")"
  echo "ThunderKittens $tk_full"
} >"$DEST.tmp/SOURCES"

rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
echo "hazy_fetch: $DEST ready ($(du -sk "$DEST" | cut -f1) KiB): $(tr '\n' ' ' <"$DEST/SOURCES")"
