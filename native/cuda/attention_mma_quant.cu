// Paged decode attention on tensor cores over quantized K/V caches (fp8, q8, q4: kv_quant.cuh), for the *_quant
// ops. Same blocks, warps, splits and partials as the 16-bit kernel (attention_mma.cu), whose combine kernel
// merges them.
//
// The first version dequantized each tile into shared memory in q's dtype (convert, scale, round, store) and then
// ran the 16-bit loop on it, and loaded the scales with plain loads one tile ahead: it took the bf16 kernel's time
// for a half to a quarter of the bytes. Here the codes go from shared memory straight into mma fragments:
//
//  * Every mma is f16 x f16 -> f32, whatever q's dtype: fp8, int8 and int4 codes are exact in float16 (one cvt
//    for two fp8 codes; int8 / int4 placed under the exponent of 1024, then one subtraction or fma). q is scaled
//    once per head by a power of two that puts its largest element below 2^15 (bfloat16 -> float16 then loses
//    nothing that matters), and the scores are scaled back in fp32.
//  * Q K^T may take the dims in any order as long as q takes the same: lane t of a quad owns a contiguous quarter
//    of each K row (two 16-byte loads for fp8 / q8 at head_dim 128), which is within one q8 / q4 scale group; q
//    is loaded once in the matching order (k_dim()).
//  * P V may take the keys in any order as long as P takes the same: S columns 2t, 2t + 1 of key half h are keys
//    4t + h, 4t + 2 + h, so lane t's four P values and V's k-slots are the same keys 4t .. 4t + 3. Output dims
//    are permuted so that a lane's B column is a contiguous run of a V row: dim tile n, column c = dim
//    (D / 8) c + n.
//  * fp8's scale (one per token and head) multiplies the fp32 score (K) and P (V): its tiles need a conversion
//    only. q8 / q4 scales (one per 32 dims) multiply the float16 codes, two a half2 multiply; a lane's slice of
//    K and its run of V lie in one group each. Scales enter float16 operands relative to a power of two per
//    tile (K) or a running one (V: o holds O in its units), times a fixed headroom, so that the products stay
//    in float16's normal range.
//  * Scales travel with their codes: cp.async into the same ring stage, 3 (q4: 5) tiles in flight per warp.
//  * The loop is bound by its instruction issue, not by memory, so the copies are kept cheap: a tile that lies
//    whole in one page (every tile unless a window shifts them) takes one block-table read, made one iteration
//    ahead, and 32-bit row offsets from one base; per-key look-ups and 64-bit address arithmetic remain for a
//    split's last tile only. The softmax uses ex2.approx directly and masks keys past the end in that tile only.
#include <type_traits>

#include "attention_mma.cuh"
#include "device_utils.cuh"
#include "kv_quant.cuh"
#include "launch.cuh"
#include "quant_mma_fragments.cuh"

namespace folio::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileKeys = 16;  // keys per warp iteration: the k of the P V mma
constexpr int kMaxGroup = 16;  // query heads per block: the m of the mmas
constexpr float kLog2e = 1.4426950408889634f;
// Headroom of the float16 mma operands that carry scales relative to a power-of-two unit (ratios <= 1): fp8's
// P * v_scale / unit times 2^15 (<= 32768), q8 / q4 codes * scale / unit times 2^8 (<= 127 * 256). Small ratios
// (a token whose scale is far below its tile's largest) then stay normal floats instead of losing bits as
// subnormals; the factor comes back out in fp32.
constexpr float kFp8Headroom = 32768.0f;
constexpr float kCodeHeadroom = 256.0f;
// V's unit is kept until a tile's scales are this far below it (ratios down to 1 / 256, times the spread inside
// a tile, stay normal with the headroom above).
constexpr float kUnitSlack = 256.0f;
// The least scale a written slot holds (kv_quant.cuh); slots never written hold 0, and a tile of those alone must
// not make a unit of 0 (its inverse would be infinite).
constexpr float kMinScale = 5.9604644775390625e-08f;  // 2^-24

struct QuantMmaArgs {
  PagedAttentionParams p;
  int num_splits;  // the grid's
  SplitsByLength by_length;
  int group;       // Hq / Hkv
  int page_shift;  // log2(page_size)
  float* partial_acc;
  float* partial_ml;
};

template <int HEAD_DIM, int FMT>
struct QuantLayout {
  static constexpr int kRowBytes = HEAD_DIM / kv_elems_per_byte<FMT>();  // one key's codes
  static constexpr int kPieces = kRowBytes / 16;                          // copied in 16-byte pieces
  // one key's scales in a stage: q8 / q4 their D / 32 float16s; fp8 two words, one zero (prefetch())
  static constexpr int kScaleSlot = FMT == kFmtFp8 ? 8 : HEAD_DIM / kQuantGroup * 2;
  static constexpr int kCodeBytes = kTileKeys * kRowBytes;  // K (or V) codes of a tile
  static constexpr int kStageBytes = 2 * kCodeBytes + 2 * kTileKeys * kScaleSlot;
  static constexpr int kStages = FMT == kFmtQ4 ? 6 : 4;  // about 16 KB a warp: 3 blocks an SM fit
  static constexpr int kWarpBytes = kStages * kStageBytes;
  static constexpr int kPipeBytes = kWarps * kWarpBytes;
  static constexpr int kMergeBytes = kWarps * kMaxGroup * (HEAD_DIM + 2) * 4;  // per warp: O rows, max, sum
  static constexpr int kSmemBytes = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
  static constexpr int kSliceBytes = kRowBytes / 4;  // a quad lane's quarter of a K row
  static constexpr int kRunBytes = kRowBytes / 8;    // a lane's run of a V row: one element per dim tile
  static_assert(kPieces >= 2 && 32 % kPieces == 0, "a warp copies whole rows of a tile per pass");
  static_assert(kSliceBytes % 4 == 0 && kRunBytes % 4 == 0, "slices and runs are whole words");
  static_assert(FMT == kFmtFp8 || (HEAD_DIM / 4 <= kQuantGroup && HEAD_DIM / 8 <= kQuantGroup),
                "a K slice and a V run lie in one scale group");
  static_assert(kStageBytes % 16 == 0, "stages keep 16-byte alignment");
};

// Lane (g = lane / 4, t = lane % 4) holds S and P rows g (r = 0) and g + 8 (r = 1) = query heads head0 + g, +8;
// S columns 2t, 2t + 1 of key half h = keys 4t + h, 4t + 2 + h; O dim tile n columns 2t, 2t + 1 = dims
// (D / 8) 2t + n, (D / 8) (2t + 1) + n.
template <typename T, int HEAD_DIM, int FMT>
__global__ void __launch_bounds__(kThreads, 3) decode_attention_mma_quant_kernel(QuantMmaArgs a) {
  using L = QuantLayout<HEAD_DIM, FMT>;
  constexpr int kSteps = HEAD_DIM / 16;  // k16 steps of Q K^T
  constexpr int kDimTiles = HEAD_DIM / 8;
  constexpr int kStages = L::kStages;
  constexpr int kSliceWords = L::kSliceBytes / 4;
  constexpr int kRunWords = L::kRunBytes / 4;
  extern __shared__ __align__(128) unsigned char smem[];
  grid_dependency_wait();  // q and the newest cache slots come from the previous kernel (launch.cuh)
  allow_dependent_launch();

  const PagedAttentionParams& p = a.p;
  const int64_t row = blockIdx.x;  // = sequence (decode)
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int head0 = kv_head * a.group;

  int64_t key_begin = 0, key_end = 0;
  const int splits = decode_split(p, a.by_length, row, split, a.page_shift, kTileKeys, key_begin, key_end);
  if (splits == 0) return;
  const int num_tiles = key_end > key_begin ? static_cast<int>((key_end - key_begin + kTileKeys - 1) / kTileKeys) : 0;

  // q as float16 A fragments in k_dim() order, each head times 2^e with its largest |element| * 2^e < 2^15;
  // row_scale: what turns a row's q.k back into a score in log2 units (exp2 below).
  uint32_t qa[kSteps][4];
  float row_scale[2];
  {
    const T* q_row = static_cast<const T*>(p.q) + row * p.q_stride_token;
    float qv[2][kSteps][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int h = g + 8 * r;
      const bool present = h < a.group;
      const T* q_head = q_row + (head0 + (present ? h : 0)) * p.q_stride_head + t * (HEAD_DIM / 4);
      float amax = 0.0f;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          qv[r][s][i] = present ? to_float<T>(q_head[k_dim<FMT>(s, i)]) : 0.0f;
          amax = fmaxf(amax, fabsf(qv[r][s][i]));
        }
      }
      amax = lanes_max<4>(amax);
      const int biased_exponent = (__float_as_int(amax) >> 23) & 0xFF;
      const int e = amax > 0.0f ? min(max(141 - biased_exponent, -126), 126) : 0;  // 14 - floor(log2(amax))
      const float up = __int_as_float((127 + e) << 23), down = __int_as_float((127 - e) << 23);
      row_scale[r] = p.scale * kLog2e * down;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        qa[s][r] = pack_half2(qv[r][s][0] * up, qv[r][s][1] * up);
        qa[s][r + 2] = pack_half2(qv[r][s][2] * up, qv[r][s][3] * up);
      }
    }
  }
  // Soft-capping in log2 units: c * tanh(s / c) with c = softcap * log2(e).
  const float softcap2 = p.softcap * kLog2e;
  const float inv_softcap2 = p.softcap > 0.0f ? 1.0f / softcap2 : 0.0f;

  float o[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // l: this lane's part of the row sums
  float v_unit = 0.0f;  // o holds O * headroom / v_unit (a power of two; 0 before the first tile)

  unsigned char* const warp_ptr = smem + warp * L::kWarpBytes;
  const uint32_t warp_smem = static_cast<uint32_t>(__cvta_generic_to_shared(warp_ptr));
  const int32_t* block_table = p.block_tables + row * p.block_table_stride;
  const int64_t slot_mask = (int64_t{1} << a.page_shift) - 1;
  const unsigned char* k_codes = static_cast<const unsigned char*>(p.k_cache) + kv_head * p.cache_stride_head;
  const unsigned char* v_codes = static_cast<const unsigned char*>(p.v_cache) + kv_head * p.cache_stride_head;
  const uint16_t* k_scales = static_cast<const uint16_t*>(p.quant.k_scale) + kv_head * p.quant.scale_stride_head;
  const uint16_t* v_scales = static_cast<const uint16_t*>(p.quant.v_scale) + kv_head * p.quant.scale_stride_head;

  // One key's scales (of K or V) into its slot of a stage, or zeros when !valid.
  auto copy_scales = [&](uint32_t dst, const uint16_t* src, bool valid) {
    if constexpr (FMT == kFmtFp8) {
      // One float16; cp.async moves aligned words of 4 bytes at least. The aligned word holding the scale goes to
      // the slot's first word when the scale is its low half, else to the second, and the other word is
      // zero-filled: the scale is then (first & 0xFFFF) | (second >> 16). (The word stays inside the scale
      // tensor's allocation: its base is 4-byte aligned, decode_attention_mma_quant_applies().)
      const uintptr_t address = reinterpret_cast<uintptr_t>(src);
      const void* word = reinterpret_cast<const void*>(address & ~uintptr_t{3});
      const bool high = (address & 2u) != 0;
      cp_async_bytes<4>(dst, word, valid && !high);
      cp_async_bytes<4>(dst + 4, word, valid && high);
    } else {
      cp_async_bytes<L::kScaleSlot>(dst, src, valid);
    }
  };
  // A page's strides and the offsets inside one page fit 32 bits (decode_attention_mma_quant_applies()): the page
  // index times its stride is one widening multiply.
  const int32_t page_bytes = static_cast<int32_t>(p.cache_stride_page);
  const int32_t slot_bytes = static_cast<int32_t>(p.cache_stride_slot);
  const int32_t scale_page_elems = static_cast<int32_t>(p.quant.scale_stride_page);
  const int32_t scale_slot_elems = static_cast<int32_t>(p.quant.scale_stride_slot);

  // The block-table entry of a tile whose keys all exist and lie in one page (the common case: pages hold whole
  // tiles when no window shifts them), else -1: such a tile is copied key by key. Loaded one iteration before its
  // copies are issued, so that their addresses never wait for this load.
  auto whole_tile_page = [&](int tile) -> int32_t {
    const int64_t tile_begin = key_begin + static_cast<int64_t>(tile) * kTileKeys;
    const bool whole = tile_begin + kTileKeys <= key_end &&
                       (tile_begin >> a.page_shift) == ((tile_begin + kTileKeys - 1) >> a.page_shift);
    return whole ? block_table[tile_begin >> a.page_shift] : -1;
  };

  // Tile `tile`'s codes and scales into stage `stage`. Codes: lane l copies piece l % kPieces of keys
  // l / kPieces + j * (32 / kPieces) (a key's row is consecutive lanes: one coalesced read). Scales: lane l those
  // of key l % 16 of K (l < 16) or V. Keys past the end are zero-filled (scale 0: they add nothing).
  auto prefetch = [&](int tile, int stage, int32_t page) {
    const int64_t tile_begin = key_begin + static_cast<int64_t>(tile) * kTileKeys;
    const uint32_t k_dst = warp_smem + stage * L::kStageBytes, v_dst = k_dst + L::kCodeBytes;
    constexpr int kKeysPerPass = 32 / L::kPieces;
    const int piece = lane % L::kPieces;
    const int key = lane % kTileKeys, kv = lane / kTileKeys;  // whose scales this lane copies
    const uint32_t scale_dst = v_dst + L::kCodeBytes + (kv * kTileKeys + key) * L::kScaleSlot;
    const uint16_t* scales = kv == 0 ? k_scales : v_scales;
    if (page >= 0) {  // whole tile in one page: one base address, 32-bit offsets (slot strides are small)
      const int32_t slot0 = static_cast<int32_t>(tile_begin & slot_mask);
      const int64_t tile_offset = static_cast<int64_t>(page) * page_bytes + (slot0 * slot_bytes + piece * 16);
      const unsigned char* k_src = k_codes + tile_offset;
      const unsigned char* v_src = v_codes + tile_offset;
#pragma unroll
      for (int j = 0; j < kTileKeys / kKeysPerPass; ++j) {
        const int tile_key = lane / L::kPieces + j * kKeysPerPass;
        const int32_t offset = tile_key * slot_bytes;
        const uint32_t at = tile_key * L::kRowBytes + swizzled_piece<L::kPieces>(tile_key, piece) * 16;
        cp_async_bytes<16>(k_dst + at, k_src + offset, true);
        cp_async_bytes<16>(v_dst + at, v_src + offset, true);
      }
      const int64_t scale_offset = static_cast<int64_t>(page) * scale_page_elems + (slot0 + key) * scale_slot_elems;
      copy_scales(scale_dst, scales + scale_offset, true);
      return;
    }
#pragma unroll
    for (int j = 0; j < kTileKeys / kKeysPerPass; ++j) {
      const int tile_key = lane / L::kPieces + j * kKeysPerPass;
      const int64_t pos = tile_begin + tile_key;
      const bool valid = pos < key_end;
      int64_t offset = 0;  // invalid: any readable address, zero bytes are read from it
      if (valid) {
        offset = block_table[pos >> a.page_shift] * p.cache_stride_page + (pos & slot_mask) * p.cache_stride_slot +
                 piece * 16;
      }
      const uint32_t at = tile_key * L::kRowBytes + swizzled_piece<L::kPieces>(tile_key, piece) * 16;
      cp_async_bytes<16>(k_dst + at, k_codes + offset, valid);
      cp_async_bytes<16>(v_dst + at, v_codes + offset, valid);
    }
    const int64_t pos = tile_begin + key;
    const bool valid = pos < key_end;
    int64_t offset = 0;
    if (valid) {
      offset = block_table[pos >> a.page_shift] * p.quant.scale_stride_page +
               (pos & slot_mask) * p.quant.scale_stride_slot;
    }
    copy_scales(scale_dst, scales + offset, valid);
  };

  const int my_tiles = warp < num_tiles ? (num_tiles - warp + kWarps - 1) / kWarps : 0;
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < my_tiles) prefetch(warp + i * kWarps, i, whole_tile_page(warp + i * kWarps));
    cp_async_commit();  // possibly empty: "kStages - 1 pending" then always means "the oldest tile has landed"
  }
  int32_t next_page = kStages - 1 < my_tiles ? whole_tile_page(warp + (kStages - 1) * kWarps) : -1;
  for (int i = 0; i < my_tiles; ++i) {
    if (i + kStages - 1 < my_tiles) {
      const int32_t page = next_page;
      if (i + kStages < my_tiles) next_page = whole_tile_page(warp + (i + kStages) * kWarps);
      prefetch(warp + (i + kStages - 1) * kWarps, (i + kStages - 1) % kStages, page);
    }
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncwarp();  // every lane's copies of this tile are visible to the whole warp

    const unsigned char* k_tile = warp_ptr + (i % kStages) * L::kStageBytes;
    const unsigned char* v_tile = k_tile + L::kCodeBytes;
    const unsigned char* scale_tile = v_tile + L::kCodeBytes;
    const int64_t tile_begin = key_begin + static_cast<int64_t>(warp + i * kWarps) * kTileKeys;

    // Scales. fp8: K's and V's of keys 4t + c (this lane's S columns and P k-slots). q8 / q4: K's of the rows this
    // lane reads (keys 2g + h, its slice's group), V's of keys 4t + c (its run's group).
    float score_mult[4];  // per key 4t + c, times row_scale
    __half2 k_ratio[2] = {};
    float p_mult[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    __half2 v_ratio[2] = {};  // keys (4t, 4t + 2), (4t + 1, 4t + 3)
    float v_max;
    if constexpr (FMT == kFmtFp8) {
      float ks[4], vs[4];
#pragma unroll
      for (int c = 0; c < 4; c += 2) {
        const uint4 kw = *reinterpret_cast<const uint4*>(scale_tile + (4 * t + c) * 8);
        const uint4 vw = *reinterpret_cast<const uint4*>(scale_tile + (kTileKeys + 4 * t + c) * 8);
        ks[c] = half_bits_to_float(static_cast<uint16_t>((kw.x & 0xFFFFu) | (kw.y >> 16)));
        ks[c + 1] = half_bits_to_float(static_cast<uint16_t>((kw.z & 0xFFFFu) | (kw.w >> 16)));
        vs[c] = half_bits_to_float(static_cast<uint16_t>((vw.x & 0xFFFFu) | (vw.y >> 16)));
        vs[c + 1] = half_bits_to_float(static_cast<uint16_t>((vw.z & 0xFFFFu) | (vw.w >> 16)));
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        score_mult[c] = ks[c];
        p_mult[c] = vs[c];
      }
      v_max = lanes_max<4>(fmaxf(fmaxf(vs[0], vs[1]), fmaxf(vs[2], vs[3])));
    } else {
      const int k_group = t * (HEAD_DIM / 4) / kQuantGroup, v_group = g * (HEAD_DIM / 8) / kQuantGroup;
      float kr[2], vr[4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        kr[h] = half_bits_to_float(
            *reinterpret_cast<const uint16_t*>(scale_tile + (2 * g + h) * L::kScaleSlot + 2 * k_group));
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        vr[c] = half_bits_to_float(*reinterpret_cast<const uint16_t*>(
            scale_tile + (kTileKeys + 4 * t + c) * L::kScaleSlot + 2 * v_group));
      }
      // K: relative to a power of two >= every K scale of the tile, so that code * ratio stays in float16
      const float k_unit = pow2_ceil(fmaxf(lanes_max<32>(fmaxf(kr[0], kr[1])), kMinScale));
      const float k_inv = pow2_inverse(k_unit);
      k_ratio[0] = __float2half2_rn(kr[0] * (k_inv * kCodeHeadroom));
      k_ratio[1] = __float2half2_rn(kr[1] * (k_inv * kCodeHeadroom));
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        score_mult[c] = k_unit * (1.0f / kCodeHeadroom);
        p_mult[c] = vr[c];  // made relative to v_unit below
      }
      v_max = lanes_max<32>(fmaxf(fmaxf(vr[0], vr[1]), fmaxf(vr[2], vr[3])));
    }
    // V's unit: kept while it covers the tile's scales and is not far above them (kUnitSlack), else this tile's
    // power of two, with o rescaled by the change.
    const float tile_unit = pow2_ceil(fmaxf(v_max, kMinScale));
    const float new_unit = tile_unit > v_unit || tile_unit * kUnitSlack < v_unit ? tile_unit : v_unit;
    const float v_inv = pow2_inverse(new_unit);
    const float unit_change = v_unit * v_inv;
    v_unit = new_unit;
#pragma unroll
    for (int c = 0; c < 4; ++c) p_mult[c] *= v_inv * (FMT == kFmtFp8 ? kFp8Headroom : kCodeHeadroom);
    if constexpr (FMT != kFmtFp8) {
      v_ratio[0] = __floats2half2_rn(p_mult[0], p_mult[2]);
      v_ratio[1] = __floats2half2_rn(p_mult[1], p_mult[3]);
#pragma unroll
      for (int c = 0; c < 4; ++c) p_mult[c] = 1.0f;
    }

    // S = Q K^T for key half h: this lane's B column is key 2g + h (S column g of the half), its slice of dims.
    float sc[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sc[h][0] = sc[h][1] = sc[h][2] = sc[h][3] = 0.0f;
      uint32_t kw[kSliceWords];
      load_row_words<kSliceWords, L::kPieces, L::kRowBytes>(k_tile, 2 * g + h, t * L::kSliceBytes, kw);
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        uint32_t b0, b1;
        k_fragment<FMT>(kw, s, k_ratio[h], b0, b1);
        mma_f16(sc[h], qa[s], b0, b1);
      }
    }
    // Online softmax over this tile, rows g and g + 8; sc[h][e] is key 4t + 2 (e & 1) + h.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[h][e] *= score_mult[2 * (e & 1) + h] * row_scale[e >> 1];
    }
    if (p.softcap > 0.0f) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[h][e] = softcap2 * tanhf(sc[h][e] * inv_softcap2);
      }
    }
    if (tile_begin + kTileKeys > key_end) {  // only a split's last tile has keys past the end
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (tile_begin + 4 * t + 2 * (e & 1) + h >= key_end) sc[h][e] = -INFINITY;
        }
      }
    }
    uint32_t pa[4];  // P as the A operand of O += P V: k-slots 2t, 2t + 1, 2t + 8, 2t + 9 = keys 4t, +2, +1, +3
    float correction[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = fmaxf(fmaxf(sc[0][2 * r], sc[0][2 * r + 1]), fmaxf(sc[1][2 * r], sc[1][2 * r + 1]));
      mx = lanes_max<4>(mx);
      const float m_new = fmaxf(m[r], mx);
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = exp2_approx(m[r] - base);
      m[r] = m_new;
      float p_vals[2][2];  // [h][j]: key 4t + 2j + h
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        p_vals[h][0] = exp2_approx(sc[h][2 * r] - base);
        p_vals[h][1] = exp2_approx(sc[h][2 * r + 1] - base);
      }
      l[r] = l[r] * alpha + (p_vals[0][0] + p_vals[0][1]) + (p_vals[1][0] + p_vals[1][1]);
      correction[r] = alpha * unit_change;
      pa[r] = pack_half2(p_vals[0][0] * p_mult[0], p_vals[0][1] * p_mult[2]);      // keys 4t, 4t + 2
      pa[r + 2] = pack_half2(p_vals[1][0] * p_mult[1], p_vals[1][1] * p_mult[3]);  // keys 4t + 1, 4t + 3
    }
    // Most tiles change neither the maxima nor V's unit: skip the rescale then (one vote instead of 64 multiplies).
    if (__any_sync(kFullMask, correction[0] != 1.0f || correction[1] != 1.0f)) {
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        o[n][0] *= correction[0];
        o[n][1] *= correction[0];
        o[n][2] *= correction[1];
        o[n][3] *= correction[1];
      }
    }

    // O += P V: this lane's B column of dim tile n is dim (D / 8) g + n, its k-slots rows 4t + c (vw[c]).
    uint32_t vw[4][kRunWords];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      load_row_words<kRunWords, L::kPieces, L::kRowBytes>(v_tile, 4 * t + c, g * L::kRunBytes, vw[c]);
    }
#pragma unroll
    for (int w = 0; w < kRunWords; ++w) {
      if constexpr (FMT == kFmtQ4) {
        // per pair of rows: nibbles 0..3 of both (low half: row 4t (+1), high: row 4t + 2 (+3)), then 4..7
        uint32_t lo[2][2], hi[2][2];  // [b][which 4 nibbles]
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          lo[b][0] = __byte_perm(vw[b][w], vw[b + 2][w], 0x5410u);
          lo[b][1] = __byte_perm(vw[b][w], vw[b + 2][w], 0x7632u);
          hi[b][0] = lo[b][0] >> 8;
          hi[b][1] = lo[b][1] >> 8;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          uint32_t bb[2];
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const uint32_t src = (e % 4) < 2 ? lo[b][e / 4] : hi[b][e / 4];
            const __half2 codes = e % 2 == 0 ? int4x2_low_to_half2(src) : int4x2_high_to_half2(src);
            bb[b] = as_word(__hmul2(codes, v_ratio[b]));
          }
          mma_f16(o[8 * w + e], pa, bb[0], bb[1]);
        }
      } else {
        // per pair of rows: bytes 0, 1 of both (low bytes: row 4t (+1), high: row 4t + 2 (+3)), then 2, 3
        uint32_t pairs[2][2];  // [b][bytes 0, 1 or 2, 3]
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const uint32_t x = FMT == kFmtQ8 ? vw[b][w] ^ 0x80808080u : vw[b][w];
          const uint32_t y = FMT == kFmtQ8 ? vw[b + 2][w] ^ 0x80808080u : vw[b + 2][w];
          pairs[b][0] = __byte_perm(x, y, 0x5140u);
          pairs[b][1] = __byte_perm(x, y, 0x7362u);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          uint32_t bb[2];
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const uint32_t two = pairs[b][e / 2];
            if constexpr (FMT == kFmtFp8) {
              bb[b] = e4m3x2_to_half2(e % 2 == 0 ? two : two >> 16);
            } else {
              bb[b] = as_word(__hmul2(int8x2_to_half2(two, e % 2 == 0 ? 0x4140u : 0x4342u), v_ratio[b]));
            }
          }
          mma_f16(o[4 * w + e], pa, bb[0], bb[1]);
        }
      }
    }
    __syncwarp();  // all lanes are done reading this stage before a later prefetch refills it
  }
  cp_async_wait<0>();
  const float o_unit = v_unit * (1.0f / (FMT == kFmtFp8 ? kFp8Headroom : kCodeHeadroom));  // exact

  // Row sums over the 4 lanes of a row, then the warps merge through shared memory (the pipeline's space).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(kFullMask, l[r], 1);
    l[r] += __shfl_xor_sync(kFullMask, l[r], 2);
  }
  __syncthreads();
  float* sm_o = reinterpret_cast<float*>(smem);        // [kWarps][kMaxGroup][HEAD_DIM]
  float* sm_m = sm_o + kWarps * kMaxGroup * HEAD_DIM;  // [kWarps][kMaxGroup]
  float* sm_l = sm_m + kWarps * kMaxGroup;             // [kWarps][kMaxGroup]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = g + 8 * r;
    if (h >= a.group) continue;
    float* o_row = sm_o + (warp * kMaxGroup + h) * HEAD_DIM;
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      o_row[(HEAD_DIM / 8) * (2 * t) + n] = o[n][2 * r] * o_unit;
      o_row[(HEAD_DIM / 8) * (2 * t + 1) + n] = o[n][2 * r + 1] * o_unit;
    }
    if (t == 0) {
      sm_m[warp * kMaxGroup + h] = m[r];
      sm_l[warp * kMaxGroup + h] = l[r];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < a.group * HEAD_DIM; idx += kThreads) {
    const int h = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w * kMaxGroup + h]);
    const float base = mx == -INFINITY ? 0.0f : mx;
    float sum = 0.0f, value = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = exp2f(sm_m[w * kMaxGroup + h] - base);
      sum += sm_l[w * kMaxGroup + h] * weight;
      value += sm_o[(w * kMaxGroup + h) * HEAD_DIM + d] * weight;
    }
    const int64_t row_head = row * p.num_q_heads + head0 + h;
    if (splits == 1) {
      static_cast<T*>(p.out)[row_head * HEAD_DIM + d] = from_float<T>(sum > 0.0f ? value / sum : 0.0f);
    } else {
      const int64_t part = row_head * a.num_splits + split;
      a.partial_acc[part * HEAD_DIM + d] = value;
      if (d == 0) {
        a.partial_ml[2 * part] = mx;
        a.partial_ml[2 * part + 1] = sum;
      }
    }
  }
}

template <typename T, int HEAD_DIM, int FMT>
cudaError_t launch_quant(const QuantMmaArgs& a, int64_t num_rows, const Launch& launch) {
  constexpr int kBytes = QuantLayout<HEAD_DIM, FMT>::kSmemBytes;
  // More than 48 KB of dynamic shared memory must be allowed per kernel and device, once (benign race: every
  // writer sets the same value).
  constexpr int kMaxDevices = 64;
  static bool allowed[kMaxDevices] = {};
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  if (device < 0 || device >= kMaxDevices || !allowed[device]) {
    status = cudaFuncSetAttribute(decode_attention_mma_quant_kernel<T, HEAD_DIM, FMT>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    if (status != cudaSuccess) return status;
    if (device >= 0 && device < kMaxDevices) allowed[device] = true;
  }
  const dim3 grid(static_cast<unsigned>(num_rows), static_cast<unsigned>(a.p.num_kv_heads),
                  static_cast<unsigned>(a.num_splits));
  return launch_kernel(decode_attention_mma_quant_kernel<T, HEAD_DIM, FMT>, grid, dim3(kThreads), kBytes, launch, a);
}

template <typename T, int HEAD_DIM>
cudaError_t launch_quant_format(const QuantMmaArgs& a, int64_t num_rows, const Launch& launch) {
  switch (a.p.quant.format) {
    case KvFormat::kFp8: return launch_quant<T, HEAD_DIM, kFmtFp8>(a, num_rows, launch);
    case KvFormat::kQ8: return launch_quant<T, HEAD_DIM, kFmtQ8>(a, num_rows, launch);
    case KvFormat::kQ4: return launch_quant<T, HEAD_DIM, kFmtQ4>(a, num_rows, launch);
    case KvFormat::kNone: break;
  }
  return cudaErrorInvalidValue;
}

bool aligned_to(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

}  // namespace

bool decode_attention_mma_quant_applies(const PagedAttentionParams& p) {
  if (p.quant.format == KvFormat::kNone) return false;
  // whole 16-byte pieces of codes
  if (p.cache_stride_page % 16 || p.cache_stride_slot % 16 || p.cache_stride_head % 16) return false;
  if (!aligned16(p.k_cache) || !aligned16(p.v_cache)) return false;
  // 32-bit page strides and offsets of slots inside a page (a whole tile's copies)
  constexpr int64_t k32 = int64_t{1} << 31;
  if (p.cache_stride_page >= k32 || p.cache_stride_slot * p.page_size >= k32) return false;
  if (p.quant.scale_stride_page >= k32 || p.quant.scale_stride_slot * p.page_size >= k32) return false;
  if (p.quant.format == KvFormat::kFp8) {  // one scale a key, copied as the aligned word holding it
    return p.quant.group_size == p.head_dim && aligned_to(p.quant.k_scale, 4) && aligned_to(p.quant.v_scale, 4);
  }
  // q8 / q4: a key's D / 32 scales copied as one 4- or 8-byte piece
  const int64_t per_key = p.head_dim / kQuantGroup;
  return p.quant.group_size == kQuantGroup && p.quant.scale_stride_page % per_key == 0 &&
         p.quant.scale_stride_slot % per_key == 0 && p.quant.scale_stride_head % per_key == 0 &&
         aligned_to(p.quant.k_scale, 2 * per_key) && aligned_to(p.quant.v_scale, 2 * per_key);
}

cudaError_t decode_attention_mma_quant(const PagedAttentionParams& p, int64_t num_rows, const AttentionPlan& plan,
                                       int page_shift, float* partial_acc, float* partial_ml, const Launch& launch) {
  if (p.num_kv_heads > 65535 || plan.num_splits > 65535) return cudaErrorInvalidValue;
  QuantMmaArgs a{};
  a.p = p;
  a.num_splits = plan.num_splits;
  a.by_length = plan.by_length;
  a.group = static_cast<int>(p.num_q_heads / p.num_kv_heads);
  a.page_shift = page_shift;
  a.partial_acc = partial_acc;
  a.partial_ml = partial_ml;
  cudaError_t status = cudaSuccess;
  dispatch_scalar(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      status = cudaErrorInvalidValue;  // decode_attention_mma_applies() refuses float32
    } else if (p.head_dim == 64) {
      status = launch_quant_format<T, 64>(a, num_rows, launch);
    } else {
      status = launch_quant_format<T, 128>(a, num_rows, launch);
    }
  });
  return status;
}

}  // namespace folio::cuda
