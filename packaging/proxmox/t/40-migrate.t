#!/usr/bin/perl
# Migration between two fewerbytes storages (two pools, two servers) as pve-storage
# runs it: `storage_migrate` picks the first format both sides offer (`fewerbytes`),
# pipes `pvesm export` into `pvesm import`, and takes the volume ID the import
# prints. With snapshots, each snapshot arrives as an increment from the one before;
# an export of a snapshot's moment from a base both sides hold (what replication
# asks) carries only what changed and leaves the target disk at that snapshot; a
# missing base is refused.
#
# What runs: the plugin, as pve-storage loads it; `pvesm` is t/bin/pvesm and
# PVE::Storage is t/lib's stand-in (a storage_migrate written from pve-storage's
# behaviour). With PVE_STORAGE_SRC naming a pve-storage checkout, pve-storage's own
# storage_migrate, volume_export, volume_import, volume_*_formats and
# volume_transfer_formats (src/PVE/Storage.pm) are loaded over the stand-in's, in
# this test and in t/bin/pvesm: then only config, storage_config, activate_volumes,
# the snapshot calls, run_command and pvesm's argument parsing are stand-ins.

use strict;
use warnings;

use File::Temp qw(tempdir);
use JSON;
use Test::More;

use FewerbytesTest;
use PVE::Storage;
use PVE::Storage::Custom::FewerbytesPlugin;

my $plugin = 'PVE::Storage::Custom::FewerbytesPlugin';
my $work = tempdir('fb-pve-migrate-XXXXXX', TMPDIR => 1, CLEANUP => 1);

between_nodes();

sub uri { return scalar($plugin->path($_[0], $_[1], 'x', $_[2])) }

# The source: 16 MiB of random data, snapshot s1, 1 MiB written, s2, 1 MiB more.
my $src = start_server();
$plugin->activate_storage('fb', $src, {});
my $disk = $plugin->alloc_image('fb', $src, 100, 'raw', undef, 16 * 1024);
run_ok('sh', '-c', "head -c 16M /dev/urandom > $work/s1.raw");
run_ok('qemu-img', 'convert', '-n', '-f', 'raw', '-O', 'raw', "$work/s1.raw", uri($src, $disk));
$plugin->volume_snapshot($src, 'fb', $disk, 's1');
run_ok('qemu-io', '-f', 'raw', '-c', 'write -P 0x11 1M 1M', uri($src, $disk));
$plugin->volume_snapshot($src, 'fb', $disk, 's2');
run_ok('qemu-io', '-f', 'raw', '-c', 'write -P 0x22 4M 1M', uri($src, $disk));
for my $snap (undef, 's2') {
    my $file = "$work/" . ($snap // 'now') . '.raw';
    run_ok('qemu-img', 'convert', '-f', 'raw', '-O', 'raw', uri($src, $disk, $snap), $file);
}

# The target: another pool, another server; both storages in one configuration.
my $dst = start_server(keep => 1);
$plugin->activate_storage('fb2', $dst, {});
my $cfg_file = "$work/storage.json";
open(my $cfg_fh, '>', $cfg_file) or die "open: $!";
print $cfg_fh encode_json({ ids => { fb => $src, fb2 => $dst } });
close($cfg_fh);
$ENV{FEWERBYTES_TEST_STORAGE_CFG} = $cfg_file;
my $cfg = PVE::Storage::config();

my @log;
my $logfunc = sub { push @log, $_[0] };

# With its snapshots: each snapshot, and the disk, an increment from the one before.
my $volid = PVE::Storage::storage_migrate($cfg, "fb:$disk", undef, 'fb2',
    { with_snapshots => 1 }, $logfunc);
is($volid, "fb2:$disk", 'the disk migrates with its snapshots, under its name')
    or diag(join("\n", @log));
images_identical("$work/now.raw", uri($dst, $disk), 'holding what it holds on the source');
images_identical("$work/s1.raw", uri($dst, $disk, 's1'), 'snapshot s1 arrives as it was');
images_identical("$work/s2.raw", uri($dst, $disk, 's2'), 'and s2');
ok((grep { /Sent volume 'vm-100-disk-0\@s2' \(changes since 'vm-100-disk-0\@s1'\): 1 blocks of data, 255 by reference/ } @log),
    's2 travels as the 1 MiB written since s1 (one pattern: a block and references)') or diag(join("\n", @log));
ok((grep { /Sent volume 'vm-100-disk-0' \(changes since 'vm-100-disk-0\@s2'\): 1 blocks of data, 255 by reference/ } @log),
    'and the disk as the 1 MiB written since s2') or diag(join("\n", @log));
sub ids {
    my $info = $plugin->volume_snapshot_info(@_);
    return { map { $_ => $info->{$_}->{id} } keys %$info };
}
is_deeply(ids($dst, 'fb2', $disk), ids($src, 'fb', $disk),
    'the snapshots arrive with their identities');

# Without snapshots, to a name taken: the next free one, still as send streams.
@log = ();
$volid = PVE::Storage::storage_migrate($cfg, "fb:$disk", undef, 'fb2',
    { with_snapshots => 0, allow_rename => 1 }, $logfunc);
is($volid, 'fb2:vm-100-disk-1', 'a second copy arrives under the next free name');
images_identical("$work/now.raw", uri($dst, 'vm-100-disk-1'), 'whole');
ok((grep { /Sent volume 'vm-100-disk-0':/ } @log), 'sent as one full stream');
is_deeply(cli_json('volume', 'snapshot', 'list', 'vm-100-disk-1'), [], 'and without snapshots');

# Replication's shape: a new snapshot s3 sent from the base s2 both sides hold; the
# target disk takes s3's content.
run_ok('qemu-io', '-f', 'raw', '-c', 'write -P 0x33 8M 512k', uri($src, $disk));
$plugin->volume_snapshot($src, 'fb', $disk, 's3');
run_ok('qemu-img', 'convert', '-f', 'raw', '-O', 'raw', uri($src, $disk, 's3'), "$work/s3.raw");
@log = ();
$volid = PVE::Storage::storage_migrate($cfg, "fb:$disk", undef, 'fb2',
    { with_snapshots => 1, snapshot => 's3', base_snapshot => 's2', target_volname => $disk },
    $logfunc);
is($volid, "fb2:$disk", 'an increment from a common snapshot arrives onto the disk');
images_identical("$work/s3.raw", uri($dst, $disk), 'which now holds the snapshot sent');
images_identical("$work/s3.raw", uri($dst, $disk, 's3'), 'as the snapshot does');
ok((grep { /Sent volume 'vm-100-disk-0\@s3' \(changes since 'vm-100-disk-0\@s2'\): 2 blocks of data, 382 by reference/ } @log),
    'carrying only the 1.5 MiB written since the base (two patterns)') or diag(join("\n", @log));

# A base the target lacks is refused, and leaves nothing.
$plugin->volume_snapshot($src, 'fb', $disk, 's4');
$plugin->volume_snapshot_delete($dst, 'fb2', $disk, 's3');
eval {
    PVE::Storage::storage_migrate($cfg, "fb:$disk", undef, 'fb2',
        { with_snapshots => 1, snapshot => 's4', base_snapshot => 's3', target_volname => $disk },
        sub { });
};
like($@, qr/failed|not here/, 'an increment whose base the target lacks is refused');
ok(!(grep { $_->{name} =~ /s4/ } cli_json('volume', 'snapshot', 'list', $disk)->@*),
    'and leaves nothing');

# What is refused by format: snapshots or an increment only travel as send streams,
# so a storage offering raw+size alone shares no format with them.
is_deeply([$plugin->volume_export_formats($src, 'fb', $disk, undef, undef, 1)], ['fewerbytes'],
    'snapshots travel only in our format');
ok((grep { $_ eq 'fewerbytes' } @$PVE::Storage::KNOWN_EXPORT_FORMATS),
    'which the plugin adds to the formats pvesm accepts');

stop_server();
done_testing();
