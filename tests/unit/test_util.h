// test_util.h: the unit tests' helpers: temporary directories and safetensors
// header surgery, shared with the format tests beside their code (format/test_files.h).
#ifndef HSX_TESTS_UNIT_TEST_UTIL_H_
#define HSX_TESTS_UNIT_TEST_UTIL_H_

#include "format/test_files.h"

#endif  // HSX_TESTS_UNIT_TEST_UTIL_H_
