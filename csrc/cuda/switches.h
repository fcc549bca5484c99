// The CUDA backend's runtime switches (environment variables), read and checked once, at the first call.
#pragma once

#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

namespace flashattn {

// FLASHATTN_FWD_SM90 / FLASHATTN_BWD_SM90: on Hopper, "1" (default) runs the TMA + wgmma kernels where they can take
// the inputs, "0" the portable ones, "strict" raises where the Hopper kernel cannot take them (a test proves it ran).
enum class Sm90Use { kOff, kOn, kStrict };
// FLASHATTN_FWD_SCHEDULE, for tests and comparisons of the Hopper forward's schedules: "counter" (causal tiles from a
// counter even where zigzag rounds apply), "whole-tiles" (no stream-K split) or "stream-k" (the split at any tile
// length, batch invariance or not; never under deterministic algorithms).
enum class FwdScheduleChoice { kAuto, kCounter, kWholeTiles, kStreamK };
// FLASHATTN_DECODE_SPLITS, for tests and comparisons of the two ways of running a KV cache's key splits (the decode
// path's, and on Hopper a query chunk's; the same bits): "ctas" (a CTA per split, then the combine pass) or "in-turn"
// (one CTA runs a row group's, or a tile's, splits in turn).
enum class DecodeSplits { kAuto, kCtas, kInTurn };

struct Switches {
  Sm90Use fwd_sm90 = Sm90Use::kOn;
  Sm90Use bwd_sm90 = Sm90Use::kOn;
  bool chunked_bwd = false;      // FLASHATTN_CUDA_BWD=chunked: the chunked backward everywhere
  bool batch_invariant = true;   // FLASHATTN_BATCH_INVARIANT=0 allows the batch-dependent stream-K split
  bool decode = true;            // FLASHATTN_DECODE=0: short queries run the forward kernels, not the decode path
  FwdScheduleChoice fwd_schedule = FwdScheduleChoice::kAuto;
  DecodeSplits decode_splits = DecodeSplits::kAuto;
  // FLASHATTN_SM80_KV_TILES, for tests on GPUs with more shared memory: the portable forward from D128 with at most
  // this many K/V tiles (4, 2 or 1; 0, default: as many as the device allows), the pipelines of smaller GPUs.
  int sm80_kv_tiles = 0;
  // FLASHATTN_BWD_CTAS, for tests: the persistent Hopper backward's grid (0, default: the SM count); a small grid makes
  // every CTA run many key blocks.
  int bwd_ctas = 0;
};

namespace detail {

// The variable's value, or `unset` where it is not set (or empty); any value not in `allowed` raises.
inline std::string read_switch(const char* name, std::initializer_list<const char*> allowed, const char* unset) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return unset;
  std::string choices;
  for (const char* value : allowed) {
    if (std::strcmp(env, value) == 0) return env;
    choices += choices.empty() ? value : std::string(", ") + value;
  }
  TORCH_CHECK(false, name, " must be one of ", choices, "; got '", env, "'");
  return unset;  // not reached
}

inline Sm90Use sm90_use(const char* name) {
  const std::string value = read_switch(name, {"0", "1", "strict"}, "1");
  return value == "0" ? Sm90Use::kOff : value == "1" ? Sm90Use::kOn : Sm90Use::kStrict;
}

// A count from 1 to `most`, or 0 where the variable is not set (or empty); anything else raises.
inline int read_count_switch(const char* name, int most) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  const long value = std::strtol(env, &end, 10);
  TORCH_CHECK(*end == '\0' && value >= 1 && value <= most, name, " must be a count from 1 to ", most, "; got '", env,
              "'");
  return static_cast<int>(value);
}

inline Switches read_switches() {
  Switches s;
  s.fwd_sm90 = sm90_use("FLASHATTN_FWD_SM90");
  s.bwd_sm90 = sm90_use("FLASHATTN_BWD_SM90");
  s.chunked_bwd = read_switch("FLASHATTN_CUDA_BWD", {"fused", "chunked"}, "fused") == "chunked";
  s.batch_invariant = read_switch("FLASHATTN_BATCH_INVARIANT", {"0", "1"}, "1") == "1";
  s.decode = read_switch("FLASHATTN_DECODE", {"0", "1"}, "1") == "1";
  s.bwd_ctas = read_count_switch("FLASHATTN_BWD_CTAS", 1 << 16);
  s.sm80_kv_tiles = std::stoi(read_switch("FLASHATTN_SM80_KV_TILES", {"1", "2", "4"}, "0"));
  const std::string schedule =
      read_switch("FLASHATTN_FWD_SCHEDULE", {"auto", "counter", "whole-tiles", "stream-k"}, "auto");
  s.fwd_schedule = schedule == "counter"       ? FwdScheduleChoice::kCounter
                   : schedule == "whole-tiles" ? FwdScheduleChoice::kWholeTiles
                   : schedule == "stream-k"    ? FwdScheduleChoice::kStreamK
                                               : FwdScheduleChoice::kAuto;
  const std::string splits = read_switch("FLASHATTN_DECODE_SPLITS", {"auto", "ctas", "in-turn"}, "auto");
  s.decode_splits = splits == "ctas"      ? DecodeSplits::kCtas
                    : splits == "in-turn" ? DecodeSplits::kInTurn
                                          : DecodeSplits::kAuto;
  return s;
}

}  // namespace detail

// Read at the first call (a bad value raises there, and again at every call until it is mended).
inline const Switches& switches() {
  static const Switches s = detail::read_switches();
  return s;
}

}  // namespace flashattn
