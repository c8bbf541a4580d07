// placement_test.cc: the loader places, on every rank, exactly the bytes that
// hsx-inspect's per-rank plan (BytesPerRank, the same placement table)
// reports, for the presets at real dimensions and TP 1, 2, 4 and 8.
#include <string>

#include "gtest/gtest.h"
#include "server/model/random_model.h"
#include "server/model/tensor_specs.h"
#include "server/runtime/engine.h"
#include "tests/unit/test_util.h"

namespace hsx {
namespace {

using ::hsx::testing::TempDir;

struct PlacementCase {
  std::string preset;
  int64_t layers;  // 0: the preset's own
};

class PlacementTest : public ::testing::TestWithParam<PlacementCase> {};

TEST_P(PlacementTest, LoaderPlacesWhatTheInspectPlanCounts) {
  TempDir dir;
  ModelConfig config = *PresetConfig(GetParam().preset);
  if (GetParam().layers > 0) config.num_hidden_layers = GetParam().layers;
  GeneratorOptions options;
  options.zero_weights = true;  // structure only: placement never reads the values
  ASSERT_TRUE(WriteRandomCheckpoint(config, dir / "m", options).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir / "m");
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  for (const int tp : {1, 2, 4, 8}) {
    SCOPED_TRACE(::testing::Message() << GetParam().preset << " at TP " << tp);
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        Engine::Create(**checkpoint, {.tp = tp, .precision = ElementType::kBf16, .threads = tp});
    const absl::Status divisible = CheckTensorParallelDegree((*checkpoint)->config(), tp);
    if (!divisible.ok()) {  // the plan and the loader refuse alike
      EXPECT_EQ(engine.status(), divisible);
      continue;
    }
    ASSERT_TRUE(engine.ok()) << engine.status();
    const std::vector<int64_t> plan = BytesPerRank((*checkpoint)->config(), tp);
    int64_t total = 0;
    for (int rank = 0; rank < tp; ++rank) {
      EXPECT_EQ((*engine)->placed_bytes(rank), plan[rank]) << "rank " << rank;
      total += plan[rank];
    }
    if (tp > 1) { EXPECT_LT(plan[0], total) << "ranks share the model, not replicate it"; }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, PlacementTest,
                         ::testing::Values(PlacementCase{"tiny", 0}, PlacementCase{"small", 0},
                                           PlacementCase{"kimi-k2", 2}),
                         [](const auto& param_info) {
                           std::string name = param_info.param.preset;
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

}  // namespace
}  // namespace hsx
