#!/usr/bin/env bash
# The repository at an older commit, checked out beside this one: the "before" (and "after") trees that the
# benchmarks log's rows compare (docs/benchmarks-log.md). A detached `git worktree` of COMMIT in DIR; each
# FILE is copied in from this checkout, and each COMMIT2:FILE from that commit (a benchmark script the old
# commit did not have yet, as the row says).
#
#   scripts/worktree_at.sh COMMIT DIR [FILE | COMMIT2:FILE ...]
#   scripts/worktree_at.sh f8ce3d1 ../jaxrl-f8ce3d1
#   python scripts/bench_peers.py train --pairs 2 --jaxrl ../jaxrl-717812b ../jaxrl-f8ce3d1
#   git worktree remove ../jaxrl-f8ce3d1        # when done
#
# Exit 2 (and nothing made) when COMMIT is not a commit of this repository or DIR already exists.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: scripts/worktree_at.sh COMMIT DIR [FILE | COMMIT2:FILE ...]" >&2
  exit 2
fi
commit=$1
dir=$(realpath -m "$2")
shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
if ! git -C "$repo" rev-parse --verify --quiet "$commit^{commit}" >/dev/null; then
  echo "scripts/worktree_at.sh: $commit: not a commit of $repo (a shallow clone? git fetch --unshallow)" >&2
  exit 2
fi
if [ -e "$dir" ]; then
  echo "scripts/worktree_at.sh: $dir already exists" >&2
  exit 2
fi
git -C "$repo" worktree add --quiet --detach "$dir" "$commit"
for file in "$@"; do
  case "$file" in
    *:*) mkdir -p "$dir/$(dirname "${file#*:}")" && git -C "$repo" show "$file" > "$dir/${file#*:}" ;;
    *) mkdir -p "$dir/$(dirname "$file")" && cp "$repo/$file" "$dir/$file" ;;
  esac
done
echo "$dir: $(git -C "$dir" log -1 --format='%h %s' | cut -c1-100)"
