// The limit on failed bearer-token attempts (AuthLimiter), the log sampling of
// those failures (AuthLogSampler) and TokenAuth around them, on a fake clock.
#include "server/service/auth_limiter.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/service/auth.h"

namespace hsx {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1'700'000'000);

AuthLimits Small() {
  AuthLimits limits;
  limits.burst = 3;
  limits.refill = absl::Seconds(1);
  limits.max_addresses = 4;
  limits.log_interval = absl::Seconds(10);
  limits.log_per_address = 2;
  limits.log_total = 5;
  return limits;
}

TEST(PeerAddressTest, DropsThePortOnly) {
  EXPECT_EQ(PeerAddress("ipv4:10.0.0.1:5123"), "ipv4:10.0.0.1");
  EXPECT_EQ(PeerAddress("ipv6:[::1]:5123"), "ipv6:[::1]");
  EXPECT_EQ(PeerAddress("ipv6:%5B::1%5D:5123"), "ipv6:%5B::1%5D");
  EXPECT_EQ(PeerAddress("unix:/tmp/hsx.sock"), "unix:/tmp/hsx.sock");
  EXPECT_EQ(PeerAddress("ipv6:::1"), "ipv6:::1");  // no brackets: not ours to cut
  EXPECT_EQ(PeerAddress("ipv4:10.0.0.1"), "ipv4:10.0.0.1");
}

TEST(AuthLimiterTest, BurstThenOnePerRefill) {
  AuthLimiter limiter(Small());
  const std::string a = "ipv4:10.0.0.1";
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(limiter.Wait(a, kStart), absl::ZeroDuration()) << i;
    limiter.Failed(a, kStart);
  }
  EXPECT_EQ(limiter.Wait(a, kStart), absl::Seconds(1));
  EXPECT_NEAR(absl::ToDoubleMilliseconds(limiter.Wait(a, kStart + absl::Milliseconds(400))), 600, 1e-3);
  EXPECT_EQ(limiter.Wait("ipv4:10.0.0.2", kStart), absl::ZeroDuration()) << "another address is not held back";
  const absl::Time later = kStart + absl::Seconds(1);
  EXPECT_EQ(limiter.Wait(a, later), absl::ZeroDuration()) << "one try earned after a refill";
  limiter.Failed(a, later);
  EXPECT_EQ(limiter.Wait(a, later), absl::Seconds(1));
}

TEST(AuthLimiterTest, AFullBucketIsForgotten) {
  AuthLimiter limiter(Small());
  limiter.Failed("ipv4:10.0.0.1", kStart);
  EXPECT_EQ(limiter.addresses(), 1u);
  EXPECT_EQ(limiter.Wait("ipv4:10.0.0.1", kStart + absl::Seconds(1)), absl::ZeroDuration());
  EXPECT_EQ(limiter.addresses(), 0u);
}

TEST(AuthLimiterTest, RemembersAtMostMaxAddressesTheOldestFailureForgottenFirst) {
  AuthLimiter limiter(Small());
  for (int i = 0; i < 3; ++i) limiter.Failed("ipv4:10.0.0.1", kStart);  // the oldest, limited
  for (int n = 2; n <= 4; ++n) limiter.Failed(absl::StrCat("ipv4:10.0.0.", n), kStart + absl::Milliseconds(n));
  limiter.Failed("ipv4:10.0.0.3", kStart + absl::Milliseconds(10));  // a repeat refreshes, adds nothing
  EXPECT_EQ(limiter.addresses(), 4u);
  EXPECT_GT(limiter.Wait("ipv4:10.0.0.1", kStart), absl::ZeroDuration());
  for (int n = 5; n <= 100; ++n) limiter.Failed(absl::StrCat("ipv4:10.0.1.", n), kStart + absl::Milliseconds(20));
  EXPECT_EQ(limiter.addresses(), 4u);
  EXPECT_EQ(limiter.Wait("ipv4:10.0.0.1", kStart), absl::ZeroDuration()) << "evicted";
}

TEST(AuthLogSamplerTest, FirstFewPerAddressThenOneSummaryPerInterval) {
  AuthLogSampler sampler(Small());
  int logged = 0;
  for (int i = 0; i < 1000; ++i) {
    logged += sampler.Sample("ipv4:10.0.0.1", /*rate_limited=*/i >= 3, kStart + absl::Milliseconds(i));
  }
  EXPECT_EQ(logged, 2);
  EXPECT_TRUE(sampler.TakeSummaries(kStart + absl::Seconds(9)).empty()) << "the interval still runs";
  std::vector<std::string> summaries = sampler.TakeSummaries(kStart + absl::Seconds(10));
  ASSERT_EQ(summaries.size(), 1u);
  EXPECT_NE(summaries[0].find("998 more failed attempts"), std::string::npos) << summaries[0];
  EXPECT_NE(summaries[0].find("997 of them refused unchecked"), std::string::npos) << summaries[0];
  EXPECT_NE(summaries[0].find("ipv4:10.0.0.1"), std::string::npos) << summaries[0];
  EXPECT_TRUE(sampler.TakeSummaries(kStart + absl::Seconds(30)).empty()) << "each summary once";
  EXPECT_TRUE(sampler.Sample("ipv4:10.0.0.1", false, kStart + absl::Seconds(31))) << "a new interval";
}

TEST(AuthLogSamplerTest, AtMostLogTotalLinesWhateverTheAddresses) {
  AuthLogSampler sampler(Small());
  int logged = 0;
  for (int i = 0; i < 500; ++i) {
    logged += sampler.Sample(absl::StrCat("ipv4:10.0.", i / 250, ".", i % 250), false, kStart);
  }
  EXPECT_EQ(logged, 5);
  ASSERT_EQ(sampler.TakeSummaries(kStart + absl::Seconds(11)).size(), 1u);
}

TEST(AuthLogSamplerTest, NoSummaryWhenNothingWasLeftOut) {
  AuthLogSampler sampler(Small());
  EXPECT_TRUE(sampler.Sample("ipv4:10.0.0.1", false, kStart));
  EXPECT_TRUE(sampler.TakeSummaries(kStart + absl::Minutes(1)).empty());
}

TEST(TokenAuthTest, LimitsFailuresPerAddressAndStillLetsTheRightTokenIn) {
  TokenAuth auth("s3cret", Small());
  const std::string wrong = "Bearer guess";
  const std::string right = "Bearer s3cret";
  const std::string peer = "ipv4:10.0.0.1:1000";
  for (int i = 0; i < 3; ++i) {
    AuthVerdict v = auth.Check(absl::StrCat("ipv4:10.0.0.1:", 1000 + i), &wrong, kStart);  // new connections
    EXPECT_EQ(v.status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_FALSE(v.rate_limited);
    EXPECT_EQ(v.log, i < 2);
  }
  AuthVerdict limited = auth.Check(peer, &right, kStart + absl::Milliseconds(300));
  EXPECT_EQ(limited.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << "refused unchecked";
  EXPECT_TRUE(limited.rate_limited);
  EXPECT_NE(limited.status.error_message().find("retry in 700ms"), std::string::npos) << limited.status.error_message();
  EXPECT_EQ(auth.Check(peer, nullptr, kStart).status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(auth.Check("ipv4:10.0.0.2:1", &right, kStart).status.ok()) << "another address";
  EXPECT_TRUE(auth.Check(peer, &right, kStart + absl::Seconds(1)).status.ok()) << "after a refill";
  EXPECT_TRUE(auth.Check(peer, &right, kStart + absl::Seconds(1)).status.ok()) << "successes spend nothing";
  EXPECT_EQ(auth.Check("ipv4:10.0.0.3:1", nullptr, kStart).status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

}  // namespace
}  // namespace hsx
