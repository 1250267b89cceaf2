/*
 * Internal: test hooks of the client library (host/client.c). Not exported.
 */
#ifndef KVF_HOST_CLIENT_INTERNAL_H
#define KVF_HOST_CLIENT_INTERNAL_H

#include <stdint.h>

#include <kvferry/client.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The id the client's next request gets (ids then count up from it), so a
 * test can send a request again under the id it had, as a retry does.
 * NULL or 0 is a no-op. */
void kvf_client_test_next_request_id(kvf_client *client, uint64_t id);

/* Make the client's waits spin first for spin_us (at most a second), as
 * they do for KVF_CLIENT_SPIN_US while the live registration names a GPU, so tests
 * without a GPU run that path; 0: no spin. NULL is a no-op. */
void kvf_client_test_spin(kvf_client *client, int64_t spin_us);

/* How long the client's waits spin now, in us (0: they do not). NULL: 0. */
uint64_t kvf_client_test_spin_us(kvf_client *client);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_CLIENT_INTERNAL_H */
