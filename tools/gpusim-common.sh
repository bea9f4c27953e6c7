# Shell functions the gpusim harnesses share (tools/gpusim-matvec/run.sh,
# tools/gpusim-epilogue/run.sh); sourced, with GPUSIM, B (their build folder)
# and NVCC set.

# gpusim's lib/ must hold libcudart.so.13 as a link to libcudart.so; a copy
# that lost its links (12-byte text files) is mirrored here with real ones.
gpusim_root() {
  if [ "$(head -c 4 "$GPUSIM/lib/libcudart.so.13" 2>/dev/null | od -An -c | tr -d ' ')" = "177ELF" ]; then
    echo "$GPUSIM"
    return
  fi
  local g=$B/gpusim
  if [ ! -x "$g/run.sh" ] || [ "$GPUSIM/run.sh" -nt "$g/run.sh" ]; then
    rm -rf "$g"
    mkdir -p "$g/lib"
    cp -r "$GPUSIM/bin" "$GPUSIM/configs" "$GPUSIM/run.sh" "$g/"
    chmod -R u+w "$g"
    ln -s "$GPUSIM/lib/libcudart.so" "$g/lib/libcudart.so"
    for v in 10.0 10.1 11.0 12 13; do ln -s libcudart.so "$g/lib/libcudart.so.$v"; done
  fi
  echo "$g"
}

# The PTX the simulator runs, two rewrites of what GPGPU-Sim 4.2 gets wrong,
# each into the same bits:
# - copysign.f32: its parser has none (roundf in the q8_1 quantizers, tanhf in
#   ggml's gelu: code these launches never reach, but the syntax error drops
#   the kernels after it): d = sign bit of a | magnitude of b, by and/or.
# - shf.r.wrap.b32 with a shift of 0 (NEW's funnel shifts of 2-byte-aligned
#   q8_0 fields, every other block): it computes b << (32 - n) in C, so n 0
#   gives a | b instead of a; n = c & 31 is tested and a selected where 0.
#   Three more ALU instructions per funnel shift (12 in NEW's q8_0 kernel).
# - prefetch.global.L1/L2 (the norm's weights, a chain's rows): its parser has
#   none; a load of the line into a register nothing reads, cached where the
#   prefetch would put it (.ca: L1, .cg: L2), issues the same request without
#   a wait.
# - ld.acquire.gpu (a chain's and a missed rank's waits on their counts): its
#   parser has none; ld.global.cg reads L2, where the other SMs' writes are
#   (the simulator keeps no weaker order for the acquire to rule out).
# - nanosleep (the same waits' back-off): its parser has none; dropped, so a
#   wait polls L2 without pausing (more L2 requests while it waits, none
#   issued by the blocks it waits for).
# - trap (those waits' give-up after seconds): its instruction has no type,
#   which GPGPU-Sim asserts on when it loads the kernel; exit instead (a block
#   that gave up would end without its rows: the output hash would say so).
# - bfi.b64 with a field of 32 bits at 32 (the router's topk_code: a word
#   above an index): it inserts into the low word's 32 bits only, so the
#   field is lost; d = (b & 0xffffffff) | a << 32 by shift, and, or.
# ptxas -v gives the launched kernels the same registers either way.
sim_ptx() {
  sed -E '
    s/^([[:space:]]*)copysign\.f32[[:space:]]+(%f[0-9]+),[[:space:]]*(%f[0-9]+),[[:space:]]*(%f[0-9]+);/\1{ .reg .b32 %cs<3>; mov.b32 %cs0, \3; and.b32 %cs0, %cs0, 0x80000000; mov.b32 %cs1, \4; and.b32 %cs1, %cs1, 0x7FFFFFFF; or.b32 %cs2, %cs0, %cs1; mov.b32 \2, %cs2; }/
    s/^([[:space:]]*)prefetch\.global\.L1[[:space:]]+\[([^]]+)\];/\1{ .reg .b32 %pf; ld.global.ca.b32 %pf, [\2]; }/
    s/^([[:space:]]*)prefetch\.global\.L2[[:space:]]+\[([^]]+)\];/\1{ .reg .b32 %pf; ld.global.cg.b32 %pf, [\2]; }/
    s/ld\.acquire\.gpu\.global\./ld.global.cg./
    s/^([[:space:]]*)bfi\.b64[[:space:]]+(%rd[0-9]+),[[:space:]]*(%rd[0-9]+),[[:space:]]*(%rd[0-9]+),[[:space:]]*32,[[:space:]]*32;/\1{ .reg .b64 %bfh, %bfl; shl.b64 %bfh, \3, 32; and.b64 %bfl, \4, 4294967295; or.b64 \2, %bfl, %bfh; }/
    s/^([[:space:]]*)trap;/\1exit;/
    s/^([[:space:]]*)nanosleep\.u32[[:space:]]+[^;]+;/\1\/\/ nanosleep dropped/
    s/^([[:space:]]*)shf\.r\.wrap\.b32[[:space:]]+(%r[0-9]+),[[:space:]]*(%r[0-9]+),[[:space:]]*(%r[0-9]+),[[:space:]]*(%r[0-9]+);/\1{ .reg .pred %fsp; .reg .b32 %fsn, %fst; and.b32 %fsn, \5, 31; shf.r.wrap.b32 %fst, \3, \4, %fsn; setp.eq.u32 %fsp, %fsn, 0; selp.b32 \2, \3, %fst, %fsp; }/
  ' "$1" > "$2"
  if grep -q 'prefetch' "$2"; then echo "run.sh: a prefetch form left in $2" >&2; exit 1; fi
  if grep -q 'bfi\.b64' "$2"; then echo "run.sh: a bfi.b64 form left in $2" >&2; exit 1; fi
  if grep -q 'copysign' "$2"; then echo "run.sh: copysign left in $2" >&2; exit 1; fi
  if grep -qE '^[[:space:]]*(nanosleep|trap)|ld\.acquire' "$2"; then echo "run.sh: a wait form left in $2" >&2; exit 1; fi
  if grep -E 'shf\.' "$2" | grep -vq '%fsn;'; then echo "run.sh: a shf form left in $2" >&2; exit 1; fi
}

# The ptxas GPGPU-Sim runs for register counts (through gpusim's stand-in):
# CUDA's, with "N bytes cumulative stack size" (a kernel that calls a
# function: OLD's __noinline__ epilogue) given as "N bytes lmem", the form
# GPGPU-Sim's ptxinfo parser reads (it exits on the other).
ptxas_wrapper() {
  local w=$B/ptxas-lmem real
  real=$(dirname "$NVCC")/ptxas
  [ -x "$real" ] || real=/usr/local/cuda/bin/ptxas
  {
    echo '#!/bin/bash'
    echo 'tmp=$(mktemp) || exit 1'
    echo "'$real' \"\$@\" 2>\"\$tmp\"; rc=\$?"
    echo "sed -E 's/, ([0-9]+) bytes cumulative stack size/, \\1 bytes lmem/' \"\$tmp\" >&2"
    echo 'rm -f "$tmp"'
    echo 'exit $rc'
  } > "$w"
  chmod +x "$w"
  echo "$w"
}
