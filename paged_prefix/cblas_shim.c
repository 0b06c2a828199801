/* The three CBLAS calls MLX's CPU backend makes, forwarded to scipy-openblas32's OpenBLAS,
 * which exports them only under a scipy_ prefix (paged_prefix/cpu_blas.py loads this library
 * with RTLD_GLOBAL before mlx.core, so libmlx binds these names here and not to the reference
 * BLAS it bundles). The call counter lets cpu_blas.status() see that MLX really calls them.
 * CBLAS enums are ints in the C ABI; scipy-openblas32's blasint is int (the 32-bit build). */

#include <stdint.h>

void scipy_cblas_sgemm(int, int, int, int, int, int, float, const float *, int, const float *,
                       int, float, float *, int);
void scipy_cblas_dgemm(int, int, int, int, int, int, double, const double *, int,
                       const double *, int, double, double *, int);
void scipy_cblas_cgemm(int, int, int, int, int, int, const void *, const void *, int,
                       const void *, int, const void *, void *, int);

static uint64_t calls;

uint64_t paged_prefix_cblas_calls(void) { return __atomic_load_n(&calls, __ATOMIC_RELAXED); }

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
  scipy_cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double *a,
                 int lda, const double *b, int ldb, double beta, double *c, int ldc) {
  __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
  scipy_cblas_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void *alpha,
                 const void *a, int lda, const void *b, int ldb, const void *beta, void *c,
                 int ldc) {
  __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
  scipy_cblas_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
