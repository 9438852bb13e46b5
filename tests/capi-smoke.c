/* The C ABI from C (C99, -pedantic -Werror): the header is C, the library links and answers.
 * Creates a CPU handle, attends one segment of two tokens whose values are all equal (the output is
 * then that value exactly), and checks a failing call's status and message. */
#include <stdio.h>
#include <string.h>

#include <fovea/fovea_attn.h>

int main(void) {
  fovea_attn* h = NULL;
  const int32_t cu[2] = {0, 2};
  uint16_t qkv[2 * 3 * 64], out[2 * 64];
  fovea_attn_view q, k, v, o;
  size_t i;
  int bad = 0;
  for (i = 0; i < sizeof qkv / sizeof qkv[0]; ++i) qkv[i] = 0x3F80; /* bf16 1.0 */
  for (i = 0; i < sizeof out / sizeof out[0]; ++i) out[i] = 0x7FC0; /* NaN */
  q.data = qkv, k.data = qkv + 64, v.data = qkv + 128;
  q.stride_token = k.stride_token = v.stride_token = 3 * 64;
  q.stride_head = k.stride_head = v.stride_head = 64;
  o.data = out, o.stride_token = 64, o.stride_head = 64;
  if (fovea_attn_abi_version() != FOVEA_ATTN_ABI_VERSION)
    return printf("ABI version %d\n", fovea_attn_abi_version()), 1;
  if (fovea_attn_create(FOVEA_ATTN_BF16, FOVEA_ATTN_AUTO, 1, 64, FOVEA_ATTN_DEVICE_CPU, &h) != FOVEA_ATTN_OK ||
      fovea_attn_plan(h, cu, 1, NULL) != FOVEA_ATTN_OK ||
      fovea_attn_prepare(h, &q, &k, &v, NULL, 0.0f, NULL) != FOVEA_ATTN_OK ||
      fovea_attn_attend(h, &o, NULL) != FOVEA_ATTN_OK)
    return printf("failed: %s\n", fovea_attn_last_error()), 1;
  for (i = 0; i < sizeof out / sizeof out[0]; ++i) bad |= out[i] != 0x3F80;
  if (bad) return printf("wrong output\n"), 1;
  if (fovea_attn_plan(h, cu, 0, NULL) != FOVEA_ATTN_INVALID || strstr(fovea_attn_last_error(), "num_segments") == NULL)
    return printf("a bad plan: '%s'\n", fovea_attn_last_error()), 1;
  fovea_attn_destroy(h);
  printf("ok\n");
  return 0;
}
