/*
 * Internal: what a cache server asks of the import table beyond
 * kvferry/memory.h (host/memory/import_table.c; kvferryd uses it).
 *
 * A policy makes the table refuse what a server must not give one client
 * of another: with `owned`, every mapping belongs to the client
 * (connection) whose registration imported it, and a view of another
 * client naming its identity is refused (KVF_ERR_PERMISSION), whatever
 * descriptor comes with it. Without a policy (kvf_import_table_create's
 * table) any client's views alias any mapping, as kvferry/memory.h says.
 * Quotas cap the bytes mapped per account (the caller's grouping of
 * clients: kvferryd uses the client's process) and in the whole table: a
 * registration whose new identities would go over one is refused before
 * anything of it is imported. A mapping counts, at its identity's size,
 * from its import until its address range is freed (closing ones too).
 *
 * A registration's failure can be attributed: which view and which field
 * ("identity", "fd", "size"), so a server can name the frame's field
 * (payload.regions[3].fd_index).
 *
 * Threading: as the table (serialized on its lock).
 */
#ifndef KVF_HOST_IMPORT_TABLE_H
#define KVF_HOST_IMPORT_TABLE_H

#include <stdint.h>

#include <kvferry/memory.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvf_import_policy {
  int owned;                  /* 1: only the client that imported a mapping may alias it */
  uint64_t max_account_bytes; /* bytes mapped per account; 0: no limit */
  uint64_t max_total_bytes;   /* bytes mapped in the table; 0: no limit */
} kvf_import_policy;

/* Set the table's policy (none at create); later registrations follow it.
 * Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL). */
kvf_status kvf_import_table_set_policy(kvf_import_table *table, const kvf_import_policy *policy);

#define KVF_IMPORT_NO_VIEW UINT32_MAX

/* Why a registration failed, when it is the sender's doing. */
typedef struct kvf_import_fault {
  uint32_t view;     /* the view at fault, or KVF_IMPORT_NO_VIEW */
  const char *field; /* static: "identity", "fd" or "size" (of that view), or, with no view,
                        "quota.mapped_bytes" (the account's) or "quota.server_mapped_bytes" (the
                        table's); NULL: not attributed (a system or driver failure, an argument error) */
  char message[512]; /* the reason, without the field in front */
} kvf_import_fault;

/* kvf_import_table_register, with the quota account of the client (0: the
 * client itself) and *fault (may be NULL) filled on failure. The message
 * (kvf_last_error) names the view as kvf_import_table_register does. Over a
 * quota: KVF_ERR_BUSY. */
kvf_status kvf_import_table_register_ex(kvf_import_table *table, uint64_t client, uint64_t account,
                                        const kvf_import_view *views, uint32_t num_views, kvf_import_reg **out,
                                        kvf_import_fault *fault);

/* Bytes the mappings of `account` count for, and all of the table's
 * (either pointer may be NULL). */
void kvf_import_table_mapped_bytes(kvf_import_table *table, uint64_t account, uint64_t *account_bytes,
                                   uint64_t *total_bytes);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_IMPORT_TABLE_H */
